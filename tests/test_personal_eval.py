"""Per-client evaluation (issue 32, SPEC §7): evaluate_client against a float64 reference written
another way, the modes' differences, no state changed by evaluating, the row fields and the CLI,
the same numbers with worker processes, exact resume, bad specs. Flower's federated evaluation
and the worker processes' are checked by the engine and parallel contracts
(fedlt.testing.check_engines / check_parallel: every algorithm's per-client fields, in the
contracts' existing runs)."""

from __future__ import annotations

import copy
import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from fedlt.algorithms.personal import EvalTask, evaluate_client, stream_seed
from fedlt.algorithms.protocol import ClientStates, LocalRunner
from fedlt.cli import main
from fedlt.config import RunConfig
from fedlt.engine import client_data, prepare, train_round
from fedlt.metrics import evaluate
from fedlt.run.evaluation import ClientEvaluation, eval_clients
from fedlt.run.parts import client_test_data
from fedlt.testing import check_algorithm
from fedlt.testing.algorithms import TINY
from fedlt.testing.base import differences

CPU = torch.device("cpu")
MODES = ["global_local", "personal", "finetune(epochs=1)"]
SMALL = dict(TINY, model="mlp", clients=4, train_limit=300, test_limit=100)
FLAGS = ["--model", "mlp", "--dataset", "mnist", "--train-limit", "300", "--test-limit", "100", "--clients", "4",
         "--participation", "0.5", "--local-iters", "2", "--server-batch", "12", "--rounds", "2", "--eval-every", "1",
         "--beta", "0.5", "--quiet"]


@pytest.fixture(scope="module")
def trained(one_thread, tmp_path_factory):
    """SCAFFOLD (it keeps a control variate per client) after one round of clients 0 and 1, with
    matched client test sets."""
    config = RunConfig(**SMALL, algorithm="scaffold", rounds=2, client_test="matched(size=30)", client_eval=MODES,
                       out=tmp_path_factory.mktemp("p") / "run")
    prep = prepare(config)
    states = ClientStates()
    train_round(prep.algorithm, prep.ctx, 0, [client_data(prep, c, CPU) for c in (0, 1)], states)
    return prep, states


def _task(prep, states, mode: str, cid: int = 0, test=None, epochs: int = 1) -> EvalTask:
    evaluation = ClientEvaluation(prep, LocalRunner(), states)
    spec = next(m for m in evaluation.modes if m.name == mode)
    task = evaluation.task(spec, cid, 0, prep.algorithm.global_model().state_dict(), None)
    if mode == "finetune":
        task = dataclasses.replace(task, schedule=dataclasses.replace(task.schedule, epochs=epochs))
    return task if test is None else dataclasses.replace(task, test=test)


def reference_scores(model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int):
    """Per-class correct / total and the summed cross-entropy, in float64, one sample at a time."""
    model = copy.deepcopy(model).double().eval()
    correct, total, loss = [0] * num_classes, [0] * num_classes, 0.0
    with torch.no_grad():
        for xi, yi in zip(x.double(), y.tolist()):
            logits = model(xi[None])[0].tolist()
            top = max(range(num_classes), key=lambda c: logits[c])
            biggest = max(logits)
            loss += biggest + math.log(sum(math.exp(v - biggest) for v in logits)) - logits[yi]
            total[yi] += 1
            correct[yi] += int(top == yi)
    return correct, total, loss


def test_evaluate_client_matches_a_float64_reference(trained):
    prep, states = trained
    task = _task(prep, states, "global_local", cid=1)
    scores = evaluate_client(prep.algorithm, task)
    correct, total, loss = reference_scores(prep.algorithm.global_model(), task.test.x, task.test.y,
                                            prep.ctx.num_classes)
    assert scores.total.tolist() == total and sum(total) == len(prep.client_tests.test_indices[1]) > 0
    assert scores.correct.tolist() == correct
    assert scores.loss_sum == pytest.approx(loss, rel=1e-5)


def test_global_local_on_the_whole_test_set_is_the_generic_accuracy(trained):
    prep, states = trained
    data = prep.data
    whole = client_test_data(prep, 0, CPU)
    whole = dataclasses.replace(whole, x=data.x_test, y=data.y_test)
    scores = evaluate_client(prep.algorithm, _task(prep, states, "global_local", test=whole))
    generic = evaluate(prep.algorithm.global_model(), data.x_test, data.y_test, data.num_classes)
    assert int(scores.correct.sum()) / int(scores.total.sum()) == generic["accuracy"]
    assert scores.loss_sum / len(data.y_test) == pytest.approx(generic["loss"], rel=1e-6)


class Constant(nn.Module):
    def __init__(self, num_classes: int, label: int) -> None:
        super().__init__()
        self.num_classes, self.label = num_classes, label

    def forward(self, x):
        return nn.functional.one_hot(torch.full((len(x),), self.label), self.num_classes).float()


def test_global_local_in_one_pass_equals_the_per_client_loop(trained):
    prep, states = trained
    evaluation = ClientEvaluation(prep, LocalRunner(), states)
    model = prep.algorithm.global_model()
    one_pass = evaluation.global_local(model)
    assert [s.cid for s in one_pass] == evaluation.clients == [0, 1, 2, 3]
    shared = np.intersect1d(prep.client_tests.test_indices[0], prep.client_tests.test_indices[1])
    assert len(shared)  # clients share test rows: each is scored once and counted for both
    for scores in one_pass:
        alone = evaluate_client(prep.algorithm, _task(prep, states, "global_local", cid=scores.cid))
        assert torch.equal(scores.correct, alone.correct) and torch.equal(scores.total, alone.total)
        assert scores.loss_sum == pytest.approx(alone.loss_sum, rel=1e-12)  # float64 sums in another order


def test_personal_is_the_algorithms_own_model_and_the_global_one_without(trained):
    prep, states = trained
    task = _task(prep, states, "personal")
    plain = evaluate_client(prep.algorithm, task)
    alone = evaluate_client(prep.algorithm, _task(prep, states, "global_local"))
    assert torch.equal(plain.correct, alone.correct) and plain.loss_sum == alone.loss_sum

    class WithPersonal:  # the algorithm, plus a personal model that always answers the client's label 3
        def __init__(self, algorithm):
            self.algorithm, self.asked = algorithm, []

        def global_model(self):
            return self.algorithm.global_model()

        def personal_model(self, task):
            self.asked.append((task.cid, sorted(task.state)))
            return Constant(prep.ctx.num_classes, 3)

    algorithm = WithPersonal(prep.algorithm)
    own = evaluate_client(algorithm, task)
    assert algorithm.asked == [(0, sorted(states.get(0)))] and states.get(0)  # it got the client's stored state
    counts = torch.bincount(task.test.y, minlength=prep.ctx.num_classes)
    assert own.correct.tolist() == [int(counts[3]) if c == 3 else 0 for c in range(prep.ctx.num_classes)]
    # the evaluator scores personal with the personal model when there is one, else as global_local
    row = ClientEvaluation(dataclasses.replace(prep, algorithm=WithPersonal(prep.algorithm)), LocalRunner(), states)(1)
    assert row["personal_client_accuracy"][0] == pytest.approx(float(counts[3]) / len(task.test.y), abs=1e-6)
    assert row["personal_client_accuracy"] != row["global_local_client_accuracy"]


def test_finetune_trains_a_copy_in_a_stream_of_its_own(trained):
    prep, states = trained
    before = copy.deepcopy(prep.algorithm.global_model().state_dict())
    rng = torch.get_rng_state()
    tuned = evaluate_client(prep.algorithm, _task(prep, states, "finetune", epochs=3))
    again = evaluate_client(prep.algorithm, _task(prep, states, "finetune", epochs=3))
    base = evaluate_client(prep.algorithm, _task(prep, states, "global_local"))
    assert tuned.loss_sum != base.loss_sum  # the model was trained
    assert torch.equal(tuned.correct, again.correct) and tuned.loss_sum == again.loss_sum  # deterministic
    assert not differences(before, prep.algorithm.global_model().state_dict(), 0.0, rtol=0.0)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(stream_seed(s, r, c, "finetune") != s for s in range(50) for r in range(3) for c in range(3))


def test_evaluating_changes_no_state(trained):
    prep, states = trained
    before = copy.deepcopy((prep.algorithm.state_dict(), states.state_dict()))
    rng = torch.get_rng_state()
    row = ClientEvaluation(prep, LocalRunner(), states)(1)
    after = (prep.algorithm.state_dict(), states.state_dict())
    assert not differences(before, after, 0.0, rtol=0.0)
    assert torch.equal(rng, torch.get_rng_state())
    for mode in ("global_local", "personal", "finetune"):
        assert row[f"{mode}_clients"] == 4 and len(row[f"{mode}_client_accuracy"]) == 4
        assert row[f"{mode}_min"] <= row[f"{mode}_mean"] and 0 <= row[f"{mode}_mean_weighted"] <= 1
    assert row["global_local_client_accuracy"] == row["personal_client_accuracy"]  # scaffold keeps no personal model


def test_the_client_sample_is_fixed_per_seed():
    assert eval_clients(10, 1.0, 0) == list(range(10))
    sample = eval_clients(1000, 0.05, 3)
    assert len(sample) == 50 and sample == eval_clients(1000, 0.05, 3) != eval_clients(1000, 0.05, 4)
    assert eval_clients(10, 0.01, 0) == eval_clients(10, 0.01, 0) and len(eval_clients(10, 0.01, 0)) == 1


def test_holdout_trains_on_what_is_left_and_the_manifest_records_both_parts(tmp_path):
    config = RunConfig(**SMALL, algorithm="fedavg", client_test="holdout(fraction=0.25)", out=tmp_path / "r")
    prep = prepare(config)
    full, held = prep.partition.client_indices, prep.client_tests
    for k in range(4):
        train = client_data(prep, k, CPU)
        assert len(train) == len(held.train_indices[k]) == len(full[k]) - len(held.test_indices[k])
        assert torch.equal(train.class_counts, torch.bincount(train.y, minlength=10))
        assert not set(held.train_indices[k]) & set(held.test_indices[k])
    assert prep.manifest()["client_test"]["train_sha256"] and prep.manifest()["sha256"] == prep.partition.sha256


def _fields(out) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k.startswith(("finetune_", "personal_"))}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_cli_prints_and_records_the_fields(tmp_path, capsys, one_thread):
    """(The same numbers with worker processes and on Flower: the parallel and engine contracts,
    fedlt.testing.check_parallel / check_engines, compare every algorithm's per-client fields.)"""
    argv = ["run", "--algo", "fedavg", "--client-test", "matched", "--client-eval", "finetune(epochs=1)",
            "--client-eval", "personal", *FLAGS]
    main([*argv, "--out", str(tmp_path / "one")])
    shown = capsys.readouterr().out
    assert "finetune: mean" in shown and "personal: mean" in shown
    rows = _fields(tmp_path / "one")
    assert [sorted(r) == sorted(rows[0]) for r in rows] == [True, True] and rows[0]["finetune_clients"] == 4
    assert isinstance(rows[-1]["finetune_client_accuracy"], list)
    summary = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert summary["per_client"]["finetune"]["final"]["mean"] == rows[-1]["finetune_mean"]
    best = max(rows, key=lambda r: r["finetune_min"])["finetune_min"]
    assert summary["per_client"]["finetune"]["best"]["min"]["value"] == best


def test_resume_is_exact_with_per_client_evaluation(one_thread):
    check_algorithm("fedprox", model="mlp", clients=4, train_limit=300, client_test="holdout",
                    client_eval=["expected", *MODES])


@pytest.mark.parametrize("argv,field", [
    (["--client-eval", "bogus"], "client_eval: unknown mode 'bogus' (valid: expected, global_local, personal"),
    (["--client-eval", "finetune(epochs=0)"], "client_eval: finetune: epochs"),
    (["--client-eval", "finetune(lr=1)"], "client_eval: finetune: lr"),
    (["--client-eval", "personal"], "client_eval: personal tests each client on its own test set: choose one with "
                                    "client_test"),
    (["--client-eval", "personal", "--client-eval", "personal"], "personal is given twice"),
    (["--client-eval", "true", "--client-eval", "personal"], "--client-eval: true / false stand alone"),
    (["--client-eval", "personal", "--no-client-eval"], "contradict"),
    (["--client-test", "nope"], "client_test: unknown client_test 'nope' (valid: holdout, matched)"),
    (["--client-test", "holdout(fraction=1.5)"], "client_test: holdout: fraction"),
    (["--client-test", "matched(size="], "client_test"),
    (["--client-eval-fraction", "0"], "client_eval_fraction"),
])
def test_bad_per_client_settings_exit_2_with_one_line(argv, field, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["run", "--algo", "fedavg", *argv, "--out", str(tmp_path / "x")])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and field in err and "Traceback" not in err, err


def test_true_still_means_each_clients_expected_accuracy(resolved):
    assert resolved("--client-eval", "true").client_eval is True
    assert resolved("--client-eval", "expected").client_eval is True
    assert resolved("--no-client-eval").client_eval is False
    config = resolved("--client-test", "matched(size=50)", "--client-eval", "expected", "--client-eval", "personal")
    assert config.client_eval_expected() and config.client_eval_modes() == [{"name": "personal"}]
    assert config.client_test == {"name": "matched", "size": 50}


def test_a_tolerant_runner_reports_a_client_whose_evaluation_fails(trained):
    prep, states = trained

    class Failing:  # a personal model that cannot be built for client 2
        def global_model(self):
            return prep.algorithm.global_model()

        def personal_model(self, task):
            if task.cid == 2:
                raise RuntimeError("no personal model here")
            return Constant(prep.ctx.num_classes, 0)

    failing = dataclasses.replace(prep, algorithm=Failing())
    row = ClientEvaluation(failing, LocalRunner(tolerate=True), states)(1)
    assert row["personal_failed"] == {"2": "failed: RuntimeError: no personal model here"}
    assert row["personal_clients"] == 3 and row["personal_client_ids"] == [0, 1, 3]
    with pytest.raises(RuntimeError, match="no personal model"):
        ClientEvaluation(failing, LocalRunner(), states)(1)


# -- clients that never train (issue 44, docs/evaluation.md "New clients") -----------------------
def test_new_clients_are_partitioned_never_trained_and_reported_apart(one_thread, tmp_path, capsys):
    """``--new-clients 1`` beside 2 training clients: the partition has 3 parts, every round trains
    the 2 (participation 1), the new client's fields come apart (``new_clients_*``) in metrics,
    summary and report, its expected accuracy is Σ_c p_c·acc_c from its partition row (float64,
    written here), the global class counts leave its data out, and FedRep's new client gets a
    head of its own (a lower test loss than the global model's, the accuracy aside)."""
    from fedlt.report import load_runs, per_client_rows

    out = tmp_path / "run"
    main(["run", "--algo", "fedrep", "--model", "mlp", "--clients", "2", "--new-clients", "1", "--participation",
          "1", "--rounds", "1", "--train-limit", "300", "--test-limit", "100", "--local-iters", "2", "--beta", "0.5",
          "--min-size", "5", "--client-test", "matched(size=30)", "--client-eval", "expected", "--client-eval",
          "global_local", "--client-eval", "personal", "--client-eval", "finetune(epochs=1)", "--out", str(out),
          "--quiet"])
    manifest = json.loads((out / "partition.json").read_text())
    assert manifest["new_clients"] == [2] and len(manifest["class_counts"]) == 3
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["participants"] == 2 and row["global_local_clients"] == 2
    for mode in ("global_local", "personal", "finetune"):
        assert row[f"new_clients_{mode}_clients"] == 1 and f"new_clients_{mode}_client_ids" not in row
    acc = np.array(row["per_class_accuracy"], dtype=np.float64)
    p = np.array(manifest["class_counts"][2], dtype=np.float64)
    assert math.isclose(row["new_clients_client_mean_accuracy"], float(p @ acc / p.sum()), abs_tol=1e-5)
    assert row["new_clients_personal_loss"] < row["new_clients_global_local_loss"]  # its own head, trained
    summary = json.loads((out / "summary.json").read_text())
    trained = np.array(manifest["class_counts"][:2]).sum(0)
    groups = {c: g for g in ("many", "medium", "few") for c in summary["groups"][g]}
    assert all(groups[c] == ("many" if n > 100 else "few" if n < 20 else "medium") for c, n in enumerate(trained))
    assert {"new_clients_finetune", "finetune"} <= set(summary["per_client"])
    assert "new_clients_client_mean_accuracy" in summary["final"]
    assert {"new_clients_personal", "personal"} <= {r["mode"] for r in per_client_rows(load_runs([out]))}


def test_new_clients_that_nothing_evaluates_are_refused_in_one_line(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["run", "--model", "mlp", "--new-clients", "2", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1 and "new_clients" in err and "client_eval" in err
    assert not (tmp_path / "x").exists()
