"""A step's inputs reach the device as views of one buffer holding exactly the batch's lists."""
import torch

from splitserve.engine.model_runner import StepBatch
from splitserve.engine.step_inputs import StepTensors


def test_every_list_of_a_batch_comes_back_as_its_own_view():
    """Two layer groups: each has its slots and block tables."""
    batch = StepBatch(token_ids=[5, 6, 7, 8], positions=[9, 0, 1, 2], slots=[[41, 16, 17, 18], [3, 4, 5, 6]],
                      query_starts=[0, 1, 4], context_lens=[10, 3],
                      block_tables=torch.tensor([[[0, 2], [1, 0]], [[7, 8], [9, 0]]]), num_decodes=1)
    got = StepTensors.upload(batch, torch.device("cpu"))
    assert got.token_ids.tolist() == batch.token_ids
    assert got.positions.tolist() == batch.positions
    assert got.slots.tolist() == batch.slots
    assert got.query_starts.tolist() == batch.query_starts
    assert got.context_lens.tolist() == batch.context_lens
    assert got.block_tables.tolist() == batch.block_tables.tolist()
    assert got.token_ids.dtype == got.block_tables.dtype == torch.long
    assert got.token_ids.untyped_storage().data_ptr() == got.block_tables.untyped_storage().data_ptr()
