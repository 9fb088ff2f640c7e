import pytest

from torpor.errors import PreflightError, UsageError
from torpor.gpus import Gpu, Inventory
from torpor.placement import parse_device_map, plan

GIB = 1 << 30
A, B, C = "GPU-aaaaaaaa-0000-0000-0000-000000000001", "GPU-bbbbbbbb-0000-0000-0000-000000000002", \
    "GPU-cccccccc-0000-0000-0000-000000000003"


def _m(need_gib: float, uuid: str = A) -> dict:
    return {"gpus": [{"uuid": uuid, "name": "NVIDIA H200", "memory_total": 141 * GIB}],
            "processes": [{"pid": 1, "cuda": True, "gpus": [uuid], "gpu_memory": int(need_gib * GIB)}]}


def _inv(*gpus: tuple[str, str, float]) -> Inventory:
    return Inventory("580", [Gpu(i, u, n, 141 * GIB, int(f * GIB)) for i, (u, n, f) in enumerate(gpus)], [])


def test_same_gpu_when_it_has_room():
    assert plan(_m(8), _inv((A, "NVIDIA H200", 100), (B, "NVIDIA H200", 140)), {}) == {A: A}


def test_other_gpu_of_same_model_when_original_is_full_or_gone():
    assert plan(_m(8), _inv((A, "NVIDIA H200", 2), (B, "NVIDIA H200", 140)), {}) == {A: B}
    assert plan(_m(8), _inv((B, "NVIDIA H200", 140)), {}) == {A: B}


def test_other_models_and_small_gpus_are_refused_with_reasons():
    with pytest.raises(PreflightError, match="no GPU here can take NVIDIA H200"):
        plan(_m(8), _inv((B, "NVIDIA A100", 80)), {})
    with pytest.raises(PreflightError, match="free, the checkpoint needs 8.00 GiB"):
        plan(_m(8), _inv((A, "NVIDIA H200", 4)), {A: A})
    with pytest.raises(PreflightError, match="is a NVIDIA A100"):
        plan(_m(8), _inv((A, "NVIDIA H200", 100), (C, "NVIDIA A100", 80)), {A: C})
    with pytest.raises(PreflightError, match="not on this host"):
        plan(_m(8), _inv((A, "NVIDIA H200", 100)), {A: C})


def test_explicit_map_wins_and_must_name_a_checkpoint_gpu():
    inv = _inv((A, "NVIDIA H200", 100), (B, "NVIDIA H200", 100))
    assert plan(_m(8), inv, {A: B}) == {A: B}
    assert plan(_m(8), inv, {A: A}) == {A: A}
    with pytest.raises(UsageError, match="not a GPU of this checkpoint"):
        plan(_m(8), inv, {B: A})


def test_parse_device_map():
    assert parse_device_map([f"{A}={B}", f"{B}={A},{C}={C}"]) == {A: B, B: A, C: C}
    for bad in ["x", "=y", "x="]:
        with pytest.raises(UsageError):
            parse_device_map([bad])


def _two_gpu_program(by_gpu: bool) -> dict:
    """One process on GPUs A and B holding 100 GiB on A and 1 GiB on B."""
    p = {"pid": 1, "cuda": True, "gpus": [A, B], "gpu_memory": 101 * GIB}
    if by_gpu:
        p["gpu_memory_by_gpu"] = {A: 100 * GIB, B: 1 * GIB}
    return {"gpus": [{"uuid": u, "name": "NVIDIA H200", "memory_total": 141 * GIB} for u in (A, B)],
            "processes": [p]}


def test_a_program_on_two_gpus_is_placed_by_what_it_held_on_each():
    """Issue 6: each of its GPUs goes where what the program held on it fits; GPU A's 100 GiB
    cannot go onto a GPU with 60 free, B's 1 GiB can, and a GPU is used once."""
    inv = _inv((A, "NVIDIA H200", 60), (B, "NVIDIA H200", 130))
    assert plan(_two_gpu_program(True), inv, {}) == {A: B, B: A}
    with pytest.raises(PreflightError, match="has 60.00 GiB free, the checkpoint needs 100.00 GiB"):
        plan(_two_gpu_program(True), inv, {A: A, B: B})
    # a checkpoint without the per-GPU figures (before torpor recorded them): an even split
    assert plan(_two_gpu_program(False), inv, {}) == {A: A, B: B}


def test_two_gpus_of_one_process_never_share_one():
    inv = _inv((A, "NVIDIA H200", 130), (B, "NVIDIA H200", 130))
    with pytest.raises(PreflightError, match="takes .*0000000001 already, and one process used "
                                             "both"):
        plan(_two_gpu_program(True), inv, {A: B, B: B})
    one = _inv((A, "NVIDIA H200", 130))           # room for both, but one GPU
    with pytest.raises(PreflightError, match="no GPU here can take NVIDIA H200 .*0000000002 "
                                             r"\(GPU .*0000000002 is not on this host"):
        plan(_two_gpu_program(True), one, {})


def test_the_ranks_of_a_job_one_gpu_each_may_share_one_with_room():
    """Two processes, one GPU each (a job's ranks): onto one GPU when it has room for both,
    which is counted; onto a GPU each where there are two."""
    m = {"gpus": [{"uuid": u, "name": "NVIDIA H200", "memory_total": 141 * GIB} for u in (A, B)],
         "processes": [{"pid": 1, "cuda": True, "gpus": [A], "gpu_memory": 30 * GIB},
                       {"pid": 2, "cuda": True, "gpus": [B], "gpu_memory": 20 * GIB}]}
    assert plan(m, _inv((C, "NVIDIA H200", 60)), {}) == {A: C, B: C}
    with pytest.raises(PreflightError, match="no other NVIDIA H200 with 20.00 GiB free"):
        plan(m, _inv((C, "NVIDIA H200", 40)), {})
    assert plan(m, _inv((C, "NVIDIA H200", 60), (A, "NVIDIA H200", 60)), {}) == {A: A, B: C}


def test_a_containers_gpus_never_share_one():
    """A container's device list keeps its length (share=False), whatever its processes used."""
    m = {"gpus": [{"uuid": u, "name": "NVIDIA H200", "memory_total": 141 * GIB} for u in (A, B)],
         "processes": [{"pid": 1, "cuda": True, "gpus": [A], "gpu_memory": 30 * GIB},
                       {"pid": 2, "cuda": True, "gpus": [B], "gpu_memory": 20 * GIB}]}
    with pytest.raises(PreflightError, match="this is a container: its GPUs each need one"):
        plan(m, _inv((C, "NVIDIA H200", 60)), {A: C, B: C}, share=False)
    with pytest.raises(PreflightError, match="no GPU here can take"):
        plan(m, _inv((C, "NVIDIA H200", 60)), {}, share=False)


def test_a_restored_container_goes_to_the_gpus_its_new_spec_was_given():
    """CRI: the device plugin gives the new container its GPUs before CreateContainer restores
    into it; the checkpoint's GPUs go onto those, in order. The checkpointed container's own
    spec (podman, ctr) names the same GPUs: no map, placement as before."""
    from torpor.placement import given_map
    two = {"gpus": [{"uuid": A}, {"uuid": B}], "processes": []}
    assert given_map(_m(1), [B]) == {A: B}
    assert given_map(two, [C, A]) == {A: C, B: A}
    assert given_map(two, [B, A]) == {}                   # the same GPUs
    assert given_map(_m(1), [A]) == {} and given_map(_m(1), []) == {}
    assert given_map(two, [C]) == {}                      # not as many: placement decides
    assert plan(_m(1), _inv((A, "NVIDIA H200", 100), (B, "NVIDIA H200", 100)),
                given_map(_m(1), [B]), share=False) == {A: B}


def test_a_gpu_of_a_model_the_checkpoint_does_not_know_goes_back_onto_itself_or_as_mapped():
    """torpor-runtime lists a GPU torpord saw the processes use with name "" where NVML did
    not answer it (torpor.json's processes name listed GPUs only): it is placed on itself,
    never onto some other GPU by guess, and where a map says."""
    m = _m(8)
    m["gpus"][0]["name"] = ""
    assert plan(m, _inv((A, "NVIDIA H200", 100), (B, "NVIDIA H200", 140)), {}) == {A: A}
    with pytest.raises(PreflightError, match="does not say which model"):
        plan(m, _inv((B, "NVIDIA H200", 140)), {})
    assert plan(m, _inv((B, "NVIDIA H200", 140)), {A: B}) == {A: B}
