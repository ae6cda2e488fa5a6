"""Small builders shared by the placement tests."""
from splitserve.placement import ClusterState, PlacementRequest, PlacementThresholds, Role, WorkerLoad
from splitserve.placement.hardware import HARDWARE_CLASSES, HardwareProfile

# tight thresholds, so random states cross them (the rule tests)
LIMITS = PlacementThresholds(mixed_prompt_tokens=1000, mixed_decode_tokens=8000, max_queue_tokens=3000,
                             max_decode_queue_tokens=20000)

H100 = HARDWARE_CLASSES["h100"]
A100 = HARDWARE_CLASSES["a100"]
Spec = tuple[str, HardwareProfile, WorkerLoad]


def load(pending: int = 0, decode: int = 0, decoding: int = 0, free: int = 0, total: int = 0) -> WorkerLoad:
    return WorkerLoad(pending_prompt_tokens=pending, decode_tokens=decode, num_decoding=decoding,
                      free_kv_tokens=free, total_kv_tokens=total)


def idle(worker_id: str, hardware: HardwareProfile = H100) -> Spec:
    return worker_id, hardware, WorkerLoad()


def cluster(policy: str, prompt: list[Spec] = (), token: list[Spec] = (), mixed: list[Spec] = (),
            thresholds: PlacementThresholds = PlacementThresholds()) -> ClusterState:
    state = ClusterState(policy, thresholds)
    for home, specs in ((Role.PROMPT, prompt), (Role.TOKEN, token), (Role.MIXED, mixed)):
        for worker_id, hardware, worker_load in specs:
            state.add_worker(worker_id, home, hardware, worker_load)
    return state


def request(num_prompt_tokens: int = 100, max_tokens: int = 10, request_id: str = "r") -> PlacementRequest:
    return PlacementRequest(request_id, num_prompt_tokens, max_tokens)


def pair(state: ClusterState, placed_request: PlacementRequest = None, now: float = 0.0, exclude=()):
    """(prompt worker, token worker) of a placement, or None; asserts it moved no pools."""
    placement, moves = state.place(placed_request or request(), now, exclude)
    assert moves == []
    state.check_integrity()
    return None if placement is None else (placement.prompt_worker, placement.token_worker)
