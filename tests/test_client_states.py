"""The client-state store's files mode (fedlt.algorithms.client_states): the same answers as the
in-memory store, checkpoints that name a consistent set of files, exact resume with SCAFFOLD, a
kill -9 at any point of a checkpoint, and one line for a missing or damaged file."""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from conftest import without_timings
from hypothesis import given, settings
from hypothesis import strategies as st

import fedlt.algorithms.client_states as client_states
from fedlt import io, rundir
from fedlt.algorithms.protocol import ClientStates
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run
from fedlt.errors import FedltError


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# an operation on both stores: (kind, client, a value that makes the state)
OPS = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "clear", "get", "round", "checkpoint", "reload"]),
                         st.integers(0, 5), st.integers(0, 3)), max_size=40)


def make_state(cid: int, value: int) -> dict:
    """Nested, of several dtypes and sizes (some states fit the tiny budgets below, some do not)."""
    return {"c": torch.full((value + 1,), cid + value / 7, dtype=torch.float64),
            "n": {"steps": torch.tensor(value), "rng": torch.arange(4 * value, dtype=torch.uint8)}}


def same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(same(a[k], b[k]) if isinstance(a[k], dict) else
               (a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])) for k in a)


def state_files(folder: Path) -> set[str]:
    """The state files in ``folder`` (beside them, the store's journal)."""
    return {p.name for p in folder.iterdir() if rundir.STATE_FILE.match(p.name)} if folder.is_dir() else set()


@settings(max_examples=40, deadline=None)
@given(ops=OPS, memory_bytes=st.sampled_from([0, 60, 400, 10**9]))
def test_the_files_mode_answers_as_the_memory_store_and_checkpoints_name_their_files(ops, memory_bytes):
    reference = ClientStates()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "client_states"
        store = ClientStates(folder, memory_bytes / 2**20)
        committed, committed_reference = store.state_dict(), {}
        for kind, cid, value in ops:
            if kind in ("put", "clear"):
                state = make_state(cid, value) if kind == "put" else {}
                reference.put(cid, state)
                store.put(cid, state)
            elif kind == "get":
                assert same(store.get(cid), reference.get(cid))
            elif kind == "round":
                store.end_round()
            elif kind == "checkpoint":  # as Checkpoints.save: durable, committed, then collected
                committed = io_roundtrip(store.state_dict())
                committed_reference = {c: reference.get(c) for c in reference}
                store.sync()
                store.collect(committed)
            else:  # a kill and a resume from the last checkpoint: a new process, the same directory
                store = ClientStates(folder, memory_bytes / 2**20)
                store.load_state_dict(committed)
                store.check(folder)
                store.discard_uncommitted()
                reference = ClientStates()
                reference.load_state_dict(committed_reference)
            assert list(store) == list(reference) and len(store) == len(reference)
        assert all(same(store.get(c), reference.get(c)) for c in range(6))
        assert store.mode == ("memory" if memory_bytes == 10**9 else store.mode)
        if store.mode == "files":  # on disk: what the live store and the last checkpoint name, and newer files
            live = store.state_dict()["files"]
            named = {client_states.file_name(c, e[0]) for c, e in live.items()}
            if committed.get("format") == client_states.FILES_FORMAT:
                named |= {client_states.file_name(c, e[0]) for c, e in committed["files"].items()}
            newer = {n for n in state_files(folder) if int(n[:-3].split("-")[1]) > committed.get("generation", 0)}
            assert named <= state_files(folder) <= named | newer


def io_roundtrip(state: dict) -> dict:
    """What a checkpoint gives back (torch.save / load with weights_only)."""
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(state, Path(tmp) / "s.pt")
        return torch.load(Path(tmp) / "s.pt", weights_only=True)


def test_the_budget_decides_the_mode_and_bounds_the_cache(tmp_path):
    big = {"w": torch.zeros(2**16)}  # 256 KiB
    store = ClientStates(tmp_path / "s", memory_mb=1.0)
    for cid in range(4):
        store.put(cid, big)
    assert store.mode == "memory" and not (tmp_path / "s").exists()  # 1 MiB: still within the budget
    store.put(4, big)
    assert store.mode == "files" and len(state_files(tmp_path / "s")) == 5
    for cid in range(5):
        store.get(cid)
    assert store._cache_bytes <= 2**20 and len(store._cache) == 4  # the oldest fell out of the cache
    store.end_round()
    assert store._cache_bytes == 0 and torch.equal(store.get(2)["w"], big["w"])
    assert ClientStates().budget == float("inf")  # no directory: memory whatever the size


def scaffold(out: Path, **overrides) -> RunConfig:
    settings_ = dict(algorithm="scaffold", model="mlp", train_limit=1200, test_limit=200, clients=6,
                     participation=0.5, rounds=4, local_iters=2, server_batch=48, eval_every=1,
                     partition={"name": "dirichlet", "beta": 0.5, "min_size": 5}, client_state_memory_mb=0.0, out=out)
    return RunConfig(**(settings_ | overrides))


def final_states(out: Path) -> dict[int, dict]:
    """The client states the run's checkpoint holds, read back from their files when it names them."""
    saved = io.load_checkpoint(out / "checkpoint.pt")["client_states"]
    if saved.get("format") != client_states.FILES_FORMAT:
        return saved
    store = ClientStates(out / "client_states", 0.0)
    store.load_state_dict(saved)
    return {cid: store.get(cid) for cid in store}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("store") / "uninterrupted"
    run(scaffold(out))
    return out


def test_files_mode_gives_the_memory_runs_numbers_and_writes_only_what_changed(uninterrupted, tmp_path):
    memory = tmp_path / "memory"
    run(scaffold(memory, client_state_memory_mb=512.0))
    assert without_timings(uninterrupted) == without_timings(memory)
    on_disk, in_memory = final_states(uninterrupted), final_states(memory)
    assert sorted(on_disk) == sorted(in_memory) and len(on_disk) >= 3
    assert all(same(on_disk[c], in_memory[c]) for c in on_disk)
    manifest = io.load_checkpoint(uninterrupted / "checkpoint.pt")["client_states"]
    assert manifest["format"] == client_states.FILES_FORMAT  # a manifest, not the states
    # one file per client with state, the one the checkpoint names; 3 writes a round, 4 rounds
    assert state_files(uninterrupted / "client_states") == {client_states.file_name(c, e[0])
                                                            for c, e in manifest["files"].items()}
    assert manifest["generation"] == 12


def test_a_stopped_scaffold_run_resumed_in_files_mode_equals_the_uninterrupted_one(uninterrupted, tmp_path):
    out = tmp_path / "stopped"  # (with workers: tests/test_parallel.py, which has a pool running)
    run(scaffold(out, rounds=2))
    (out / "summary.json").unlink()
    run(scaffold(out, rounds=4), resume=True)
    assert without_timings(out) == without_timings(uninterrupted)
    resumed, reference = final_states(out), final_states(uninterrupted)
    assert sorted(resumed) == sorted(reference) and all(same(resumed[c], reference[c]) for c in resumed)


# where a kill lands: (the call, a part of its target path, which such call) — inside a
# client-state write, between the synced files and checkpoint.pt, between checkpoint.pt and
# checkpoint.json, and in the middle of collecting the superseded files
FAULTS = {"state file written, not renamed": ("replace", "client_states", 8),
          "files synced, checkpoint.pt not renamed": ("replace", "checkpoint.pt", 3),
          "checkpoint.pt renamed, checkpoint.json not": ("replace", "checkpoint.json", 3),
          "collecting superseded files": ("unlink", "client_states", 2)}


def killed_at(fault: tuple[str, str, int], config: RunConfig) -> int:
    """Run ``config`` in a forked child that SIGKILLs itself at ``fault``; its exit signal."""
    call, where, nth = fault
    pid = os.fork()
    if pid == 0:  # the child: no handler, no finally, no flush runs after the kill
        try:
            seen = [0]
            original = getattr(os, call)

            def fatal(*args, **kwargs):
                if where in str(args[-1] if call == "replace" else args[0]):
                    seen[0] += 1
                    if seen[0] == nth:
                        os.kill(os.getpid(), signal.SIGKILL)
                return original(*args, **kwargs)

            setattr(os, call, fatal)
            run(config)
        finally:
            os._exit(3)  # the fault was never reached
    _, status = os.waitpid(pid, 0)
    return os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)


@pytest.mark.parametrize("fault", FAULTS, ids=list(FAULTS))
def test_a_kill_9_anywhere_in_a_checkpoint_then_resume_reproduces_the_uninterrupted_run(fault, uninterrupted,
                                                                                        tmp_path):
    out = tmp_path / "killed"
    assert killed_at(FAULTS[fault], scaffold(out)) == signal.SIGKILL
    assert not (out / "summary.json").exists()
    main(["run", "--resume", str(out), "--quiet"])
    assert without_timings(out) == without_timings(uninterrupted)
    resumed, reference = final_states(out), final_states(uninterrupted)
    assert sorted(resumed) == sorted(reference) and all(same(resumed[c], reference[c]) for c in resumed)
    assert not [p for p in (out / "client_states").iterdir() if p.name.endswith(".tmp")]


def resume_fails(out: Path, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["run", "--resume", str(out), "--rounds", "5", "--quiet"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_missing_or_truncated_state_file_is_one_line_and_changes_nothing(damage, uninterrupted, tmp_path, capsys):
    out = tmp_path / "run"
    os.system(f"cp -r {uninterrupted} {out}")
    (out / "summary.json").unlink()
    victim = sorted((out / "client_states").iterdir())[0]
    if damage == "missing":
        victim.unlink()
    else:
        victim.write_bytes(victim.read_bytes()[:100])
    before = {p.name: p.stat().st_mtime_ns for p in (out / "client_states").iterdir()}
    err = resume_fails(out, capsys)
    assert f"state of client {victim.name.split('-')[0]}" in err and damage.replace("truncated", "damaged") in err
    assert victim.name in err and "start a new run" in err
    assert {p.name: p.stat().st_mtime_ns for p in (out / "client_states").iterdir()} == before


def test_a_state_file_altered_in_place_is_refused_when_read(tmp_path):
    store = ClientStates(tmp_path, 0.0)
    store.put(3, make_state(3, 2))
    path = tmp_path / client_states.file_name(3, 1)
    data = bytearray(path.read_bytes())
    data[-30] ^= 1  # same size: only the sha256 tells
    path.write_bytes(bytes(data))
    store.end_round()
    with pytest.raises(FedltError, match=r"state of client 3 in .*3-00000001.pt is damaged: its sha256"):
        store.get(3)


def test_a_damaged_manifest_is_one_line(tmp_path):
    store = ClientStates(tmp_path, 0.0)
    for manifest in ({"format": client_states.FILES_FORMAT, "generation": 1, "files": {0: [2, "0" * 64, 5]}},
                     {"format": client_states.FILES_FORMAT, "generation": 3, "files": {"../x": [1, "0" * 64, 5]}},
                     {"format": client_states.FILES_FORMAT, "files": {}}):
        with pytest.raises(FedltError, match="manifest is damaged"):
            store.load_state_dict(manifest)
