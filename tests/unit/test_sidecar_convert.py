"""sidecar/convert.py: every typed value survives a trip through its protobuf message, and
agent moves keep torpor.json's nested "agent" shape on both sides of the flat AgentData."""

from __future__ import annotations

import dataclasses

import pytest

from torpor.doctor import Check
from torpor.flows import container
from torpor.sidecar import convert, proto
from torpor.sidecar.convert import (AgentData, AgentResumed, Checkpointed, Container, CudaProcess,
                                    GpuProcess, Listing, OperationInfo, OperationResult,
                                    ProcessStatus, Restored, Status, from_pb, to_pb)

pb, _ = proto()

MOVED = {"nspid": 7, "bytes": 3 << 20, "chunks": 3, "allocations": 2, "cache_released": 4096,
         "seconds": 0.25, "files": [1 << 20, 2 << 20]}
FP = {"parts": 5, "skipped": 2, "skipped_bytes": 1 << 20}

VALUES = [
    AgentData.from_moved(1234, {**MOVED, "fingerprints": FP}),
    AgentResumed(pid=9, bytes=10, seconds=0.5),
    CudaProcess(pid=1, state="RUNNING", gpu_uuids=("GPU-a", "GPU-b"), gpu_memory=3,
                gpu_memory_by_gpu={"GPU-a": 1, "GPU-b": 2}),
    Checkpointed(op_id="op", pids=(1, 2), cuda_processes=(CudaProcess(pid=1, state="RUNNING"),),
                 timings={"lock": 0.5}, deadline=12.5, container_id="c",
                 agents=(AgentData.from_moved(1, MOVED),)),
    OperationResult(op_id="op", kind="checkpoint", pids=(1,), outcome="finished",
                    timings={"resume": 0.1}, gone=(1,), resumed=(2,)),
    Restored(op_id="op", pids=(3,), timings={}, gpu_map={"GPU-a": "GPU-b"},
             agents=(AgentResumed(pid=3, bytes=1, seconds=0.0),)),
    Container(id="ctr", bundle="/b", pids=(5,), gpu_uuids=("GPU-a",), annotations={"k": "v"},
              registered_at=1.5),
    Status(processes=(ProcessStatus(pid=1, alive=True, cuda=True, state="LOCKED", op_id="op",
                                    gpu_uuids=("GPU-a",), gpu_memory=4),),
           operation=OperationInfo(op_id="op", kind="checkpoint", pids=(1, 2), cuda_pids=(1,),
                                   phase="dump", started=1.0, deadline=2.0, container_id="c")),
    Status(processes=()),
    Listing(version="1", server_pid=2, containers=(Container(id="x"),),
            operations=(), gpu_processes=(GpuProcess(pid=1, gpu_uuid="GPU-a", used_memory=9),),
            gpu_error="", op_timeout_s=600.0),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_round_trip(value):
    msg = to_pb(pb, value)
    name = convert.message_of(type(value))[0]
    assert type(msg).__name__ == name
    back = from_pb(type(value), pb.__dict__[name].FromString(msg.SerializeToString()))
    assert back == value
    assert dataclasses.is_dataclass(back)
    with pytest.raises(dataclasses.FrozenInstanceError):
        back.__setattr__(dataclasses.fields(back)[0].name, None)


def test_unset_operation_reads_back_as_none():
    assert from_pb(Status, pb.StatusResponse()).operation is None


def test_every_field_of_every_message_is_carried():
    """A field added to torpor.proto but not to its dataclass would be dropped silently."""
    for value in VALUES:
        names = {f.name for f in to_pb(pb, value).DESCRIPTOR.fields}
        assert names == {f.name for f in dataclasses.fields(value)}, type(value).__name__


def test_agent_moves_keep_the_manifest_shape():
    """runtime/checkpoint.py writes to_manifest() into torpor.json's "agent": the engine's own
    nested result, fingerprints block only when fingerprinted."""
    fp = AgentData.from_moved(1234, {**MOVED, "fingerprints": FP})
    assert fp.to_manifest() == {**MOVED, "fingerprints": FP}
    assert list(fp.to_manifest()) == [*MOVED, "fingerprints"]   # key order as before
    plain = AgentData.from_moved(1234, MOVED)
    assert plain.to_manifest() == MOVED and "fingerprints" not in plain.to_manifest()
    # through the wire and back, as torpord answers and the runtime reads
    flat = to_pb(pb, AgentData.from_moved(1234, {**MOVED, "fingerprints": FP}))
    assert flat.fingerprinted == 5 and flat.skipped == 2 and flat.skipped_bytes == 1 << 20
    assert from_pb(AgentData, flat).to_manifest() == {**MOVED, "fingerprints": FP}


def test_the_flows_types_are_the_wire_types():
    """One contract: the engine's container flows return what torpord sends as it is."""
    assert (AgentData, AgentResumed, CudaProcess, OperationResult, Restored) == \
        (container.AgentMove, container.AgentResume, container.CudaProcess,
         container.OperationResult, container.Restored)


def test_checkpointed_answer_from_the_engine():
    cuda = (CudaProcess(pid=3, state="CHECKPOINTED"),)
    moved = (AgentData.from_moved(3, MOVED),)
    ck = container.Checkpointed("op", (3, 4), (3,), cuda, moved, {"lock": 0.5})
    assert Checkpointed.of(ck, 9.5, "c") == Checkpointed(
        op_id="op", pids=(3, 4), cuda_processes=cuda, timings={"lock": 0.5}, deadline=9.5,
        container_id="c", agents=moved)


def test_restore_entries_take_what_the_engine_needs():
    msgs = [to_pb(pb, AgentData.from_moved(9, MOVED)), pb.AgentData(pid=3, nspid=1, files=[5])]
    assert convert.restore_entries(msgs) == (container.AgentEntry(9, 7, tuple(MOVED["files"])),
                                             container.AgentEntry(3, 1, (5,)))
    assert container.resumed({5: {"bytes": 1, "seconds": 0.5}, 2: {"bytes": 2, "seconds": 0.0}}) \
        == (AgentResumed(2, 2, 0.0), AgentResumed(5, 1, 0.5))


def test_container_from_a_record_with_fields_missing():
    assert Container.from_record({"id": "c", "pids": [3]}) == Container(id="c", pids=(3,))


def test_check_round_trip():
    c = Check("driver", "ok", "fine", "nothing")
    assert convert.check_from_pb(convert.check_to_pb(pb, c)) == c


def test_the_runtime_draft_takes_the_typed_answer(torpor_env):
    """torpor-runtime's torpor.json draft from LockAndCheckpoint's typed answer: the processes
    and the "agent" block as before, and the restore side reads the block back."""
    from torpor import manifest, oci
    from torpor.runtime.checkpoint import _draft
    ck = Checkpointed(op_id="op", pids=(PID_,), timings={}, deadline=0.0,
                      cuda_processes=(CudaProcess(pid=PID_, state="RUNNING", gpu_uuids=("GPU-a",),
                                                  gpu_memory=7, gpu_memory_by_gpu={"GPU-a": 7}),),
                      agents=(AgentData.from_moved(PID_, {**MOVED, "fingerprints": FP}),))
    d = _draft("ctr", {}, oci.GpuUse(), ck, PID_, leave_running=False)
    (p,) = d["processes"]
    assert (p["pid"], p["gpus"], p["gpu_memory"], p["gpu_memory_by_gpu"], p["state"]) == \
        (PID_, ["GPU-a"], 7, {"GPU-a": 7}, "RUNNING")
    assert d["agent"] == {str(PID_): {**MOVED, "fingerprints": FP}}
    assert d["sizes"]["gpu_memory"] == 7
    (entry,) = manifest.agents(d).values()
    assert AgentData.from_moved(PID_, entry) == ck.agents[0]


PID_ = 4321


def test_a_containers_agent_move_carries_its_zero_bytes():
    """The parts the agent found zero (issue 20) reach a container's torpor.json through
    torpord: zero_bytes on the wire and in the entry; an entry without any has no key."""
    moved = AgentData.from_moved(1234, {**MOVED, "zero_bytes": 7 << 30})
    flat = to_pb(pb, moved)
    assert flat.zero_bytes == 7 << 30
    assert from_pb(AgentData, flat).to_manifest() == {**MOVED, "zero_bytes": 7 << 30}
    assert "zero_bytes" not in AgentData.from_moved(1234, MOVED).to_manifest()
