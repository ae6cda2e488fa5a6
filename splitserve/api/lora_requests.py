"""The bodies of vLLM's `/v1/load_lora_adapter` and `/v1/unload_lora_adapter`."""
from __future__ import annotations

from pydantic import BaseModel, Field

from splitserve.api.strict_model import STRICT
from splitserve.engine.sampling_params import MAX_LORA_NAME

MAX_LORA_PATH = 4096  # characters: a path, as the OS bounds one


class LoadLoraAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH)  # a PEFT directory on every worker's node


class UnloadLoraAdapterRequest(BaseModel):
    model_config = STRICT
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME)
