"""The client-state store trusts nothing it reads (issue 46, part B): a state file of the wrong
structure, shape or dtype, or one that is not a pickle of plain tensors, is refused in one line
naming the file even when the checkpoint's manifest was forged to match it; a checkpoint whose
in-memory states the algorithm cannot have produced likewise; the clean-ups delete only the files
the store wrote, in its own folder or in a folder ``client_states`` links to (another disk)."""

from __future__ import annotations

import hashlib
import io as bytes_io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import fedlt.algorithms.client_states as client_states
from fedlt import io
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import run

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

PLANTED = ("3-00000999.pt", "0-00000002.pt", ".3-00000999.pt.abc.tmp", "notes.txt")


def scaffold(out: Path, **overrides) -> RunConfig:
    """Two clients, both sampled: every round writes two states (files mode from the first)."""
    settings = dict(algorithm="scaffold", model="mlp", train_limit=200, test_limit=100, clients=2, participation=1.0,
                    rounds=1, local_iters=1, server_batch=16, partition={"name": "iid"},
                    client_state_memory_mb=0.0, out=out)
    return RunConfig(**(settings | overrides))


@pytest.fixture(scope="module")
def one_round(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("hostile_store") / "run"
    run(scaffold(out))
    (out / "summary.json").unlink()
    return out


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run_dir, out, symlinks=True)
    return out


def forge(out: Path, cid: int, data: bytes) -> Path:
    """Client ``cid``'s state file replaced by ``data``, the checkpoint's manifest made to match."""
    saved = io.load_checkpoint(out / "checkpoint.pt")
    entry = saved["client_states"]["files"][cid]
    path = out / "client_states" / client_states.file_name(cid, entry[0])
    path.write_bytes(data)
    saved["client_states"]["files"][cid] = [entry[0], hashlib.sha256(data).hexdigest(), len(data)]
    io.save_checkpoint(out / "checkpoint.pt", saved)
    return path


def state_bytes(state) -> bytes:
    buffer = bytes_io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def resume_refused(out: Path, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(["run", "--resume", str(out), "--rounds", "2", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def scaffold_state(out: Path, cid: int) -> dict:
    saved = io.load_checkpoint(out / "checkpoint.pt")["client_states"]
    store = client_states.ClientStates(out / "client_states", 0.0)
    store.load_state_dict(saved)
    return store.get(cid)


@pytest.mark.parametrize("change", ["shape", "dtype", "extra key", "missing key", "not a mapping"])
def test_hostile_store_refuses_a_state_the_algorithm_cannot_produce(change, one_round, tmp_path, capsys):
    out = copy_of(one_round, tmp_path)
    state = scaffold_state(out, 1)
    name = next(iter(state["c"]))
    if change == "shape":
        state["c"][name] = torch.zeros(3)
    elif change == "dtype":
        state["c"][name] = state["c"][name].double()
    elif change == "extra key":
        state["planted"] = torch.zeros(1)
    elif change == "missing key":
        del state["c"][name]
    else:
        state = [torch.zeros(1)]
    path = forge(out, 1, state_bytes(state))
    before = sorted(p.name for p in out.iterdir())
    err = resume_refused(out, capsys)
    assert str(path) in err and "this run's algorithm" in err, err
    wanted = {"shape": "shape (3,)", "dtype": "float64", "extra key": "'planted'", "missing key": f"lacks {name!r}",
              "not a mapping": "not a mapping"}[change]
    assert wanted in err, err
    assert sorted(p.name for p in out.iterdir()) == before and not (out / "summary.json").exists()


class Payload:
    def __reduce__(self):
        return (os.system, ("echo planted-code-ran",))


def test_hostile_store_refuses_a_pickle_that_is_not_plain_tensors_in_one_line(one_round, tmp_path, capsys):
    out = copy_of(one_round, tmp_path)
    path = forge(out, 0, pickle.dumps({"c": Payload()}))
    err = resume_refused(out, capsys)
    assert str(path) in err and "state of client 0" in err and "os.system" not in capsys.readouterr().out
    assert "planted-code-ran" not in err and "refused" in err


def test_hostile_store_refuses_a_checkpoint_holding_states_of_another_shape(tmp_path, capsys):
    out = tmp_path / "memory"
    run(scaffold(out, client_state_memory_mb=512.0))
    (out / "summary.json").unlink()
    saved = io.load_checkpoint(out / "checkpoint.pt")
    name = next(iter(saved["client_states"][0]["c"]))
    saved["client_states"][0]["c"][name] = torch.zeros(7)
    io.save_checkpoint(out / "checkpoint.pt", saved)
    err = resume_refused(out, capsys)
    assert "checkpoint.pt holds a state for client 0" in err and "shape (7,)" in err, err


def plant(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True, exist_ok=True)
    planted = {name: f"not fedlt's: {name}".encode() for name in PLANTED}
    for name, data in planted.items():
        (folder / name).write_bytes(data)
    return planted


def untouched(folder: Path, planted: dict[str, bytes]) -> bool:
    return all((folder / name).read_bytes() == data for name, data in planted.items())


@pytest.mark.parametrize("where", ["own folder", "linked folder"])
def test_hostile_store_cleanups_delete_only_files_the_store_wrote(where, one_round, tmp_path):
    out = copy_of(one_round, tmp_path)
    folder = out / "client_states"
    if where == "linked folder":  # moved to another disk between the run and its resume
        elsewhere = tmp_path / "bigdisk" / "states"
        elsewhere.parent.mkdir()
        shutil.move(folder, elsewhere)
        folder.symlink_to(elsewhere, target_is_directory=True)
        folder = elsewhere
    planted = plant(folder)
    # a file the killed run wrote after its checkpoint (journaled): the resume removes it
    saved = io.load_checkpoint(out / "checkpoint.pt")["client_states"]
    leftover = client_states.file_name(1, saved["generation"] + 1)
    with open(folder / "written.txt", "a") as journal:
        journal.write(f"{leftover}\n")
    (folder / leftover).write_bytes(b"half a state")
    main(["run", "--resume", str(out), "--rounds", "3", "--quiet"])
    assert json.loads((out / "summary.json").read_text())["rounds"] == 3
    assert untouched(folder, planted) and not (folder / leftover).exists()
    manifest = io.load_checkpoint(out / "checkpoint.pt")["client_states"]
    named = {client_states.file_name(c, e[0]) for c, e in manifest["files"].items()}
    on_disk = {p.name for p in folder.iterdir() if p.name.endswith(".pt") and p.name not in planted}
    assert on_disk == named and manifest["generation"] == 6  # the superseded generations were collected
    assert {line for line in (folder / "written.txt").read_text().split()} == named


def test_hostile_store_a_refused_new_run_removes_only_its_own_state_files(tmp_path):
    from fedlt import rundir

    out = tmp_path / "new"
    folder = out / "client_states"
    planted = plant(folder)
    store = client_states.ClientStates(folder, 0.0)
    store.put(0, {"c": torch.zeros(2)})
    written = client_states.file_name(0, 1)
    assert (folder / written).is_file()
    rundir.discard_unstarted(out)
    assert not (folder / written).exists() and untouched(folder, planted)


def test_hostile_store_the_template_holds_what_the_runs_upload_plan_keeps(tmp_path, capsys):
    """The upload chain's state (an error-feedback residual, its layout set by the privacy clip
    before it) is part of a client's: the template is built through the run's own upload plan, so a
    resume is not refused for it."""
    out = tmp_path / "uploads"
    config = scaffold(out, client_state_memory_mb=512.0, clients=3, participation=1.0,
                      upload="topk(fraction=0.1, error_feedback=true)",
                      privacy={"name": "local", "noise_multiplier": 0.5, "clip": 1.0})
    run(config)
    (out / "summary.json").unlink()
    main(["run", "--resume", str(out), "--rounds", "2", "--quiet"])
    assert json.loads((out / "summary.json").read_text())["rounds_trained"] == 2
    assert "upload" in io.load_checkpoint(out / "checkpoint.pt")["client_states"][0]
