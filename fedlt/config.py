"""The run configuration: validated once, at the boundary, by pydantic.

A ``RunConfig`` can be written in Python, loaded from a TOML / YAML / JSON file, and overridden by
CLI flags. Component parameters (partitioner, algorithm) are validated by building the component,
so a bad ``beta`` is reported as ``partition: ... beta ...`` before any data is loaded.
"""

from __future__ import annotations

import inspect
import json
import math
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationError, ValidationInfo, field_validator,
                      model_validator)

import fedlt.algorithms
import fedlt.augment
import fedlt.availability
import fedlt.client_tests
import fedlt.datasets
import fedlt.models
import fedlt.partitioners
import fedlt.posthoc
import fedlt.privacy
import fedlt.transforms
from fedlt import safe_yaml
from fedlt.algorithms import compatibility
from fedlt.algorithms.authors import AUTHORS, authors_settings, fill, why_none
from fedlt.algorithms.personal import MODES as EVAL_MODES, eval_mode_of
from fedlt.bounds import MAX_ROUNDS  # noqa: F401  (one bound, shared with the algorithms' round counts)
from fedlt.errors import FedltError, describe
from fedlt.registry import Registry, create_from_spec
from fedlt.spec import DEFAULT_PARTITION, MAX_DEPTH, data_depth, numbers_are_numbers, parse_spec  # noqa: F401

# Bounds of the settings with no natural maximum (docs/runs.md, "Bounds").
MAX_LOCAL_ITERS = 100_000
MAX_LOCAL_EPOCHS = 1_000
MAX_BATCH = 1_000_000
MAX_WORKERS = 1_024  # processes, not threads: beyond any one machine's cores (a typo, not a plan)
# torch's intra-op threads per process: beyond this torch (OpenMP) fails to create them, and past
# a long long it crashes the interpreter (--threads 99999999 was a segmentation fault)
MAX_THREADS = 1_024



def _engine_check(obj: Any) -> str | None:
    return None if callable(obj) else f"{type(obj).__name__} is not callable (an engine runs a RunConfig)"


# Engines, known here by name only: ``engine(config, *, resume, on_round, on_start) -> summary``.
# The built-ins are declared by module path and imported on first use (as entry points are); a
# third-party engine registers under the entry-point group ``fedlt.engines``.
ENGINES: Registry = Registry("engine", entry=_engine_check)
ENGINES.declare("local", "fedlt.engine:local_engine")
ENGINES.declare("flower", "fedlt.flower.simulation:run")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _numbers_are_numbers(cls, data: Any) -> Any:
        return numbers_are_numbers(cls, data)


def _check_component(registry, spec: dict[str, Any], what: str) -> dict[str, Any]:
    """Validate ``{"name": ..., **params}`` by creating the component (cheap, no data touched)."""
    create_from_spec(registry, spec, what)
    return spec


def _spec_strings(value: Any, what: str, nested: tuple[str, ...], whole: bool = True,
                  example: str | None = None) -> Any:
    """``value`` with spec strings read as ``{"name": ..., **params}`` tables: ``value`` itself
    (when ``whole``) and its ``nested`` keys. Anything else is left to the field's validation;
    ``example``: the hint for a string that is no spec (the field's allowed values)."""
    try:
        if whole and isinstance(value, str):
            return parse_spec(value, what, example)
        if isinstance(value, dict) and any(isinstance(value.get(k), str) for k in nested):
            return {**value, **{k: parse_spec(value[k], f"{what}.{k}") for k in nested if isinstance(value.get(k), str)}}
    except FedltError as exc:
        raise ValueError(str(exc)) from None
    return value


class Seeds(Strict):
    """Three independent streams (SPEC §6): changing one leaves the others' draws unchanged."""

    # 2**63 - 1: the largest seed every consumer (numpy, torch.manual_seed) accepts
    data: int = Field(0, ge=0, le=2**63 - 1, description="partition of the training set")
    model: int = Field(0, ge=0, le=2**63 - 1, description="model initialisation")
    sampling: int = Field(0, ge=0, le=2**63 - 1,
                          description="client sampling, local minibatch order and every other training draw")


# The largest float32: the optimiser's hyperparameters meet float32 tensors, where anything larger is inf.
FLOAT32_MAX = 3.4028234663852886e38


class Optimiser(Strict):
    """SGD on both sides (SCALA authors' defaults); ``clip`` is the total gradient norm per side.
    Every value must be finite in float32 (at most 3.4e38), as the tensors it scales are."""

    lr: float = Field(0.01, gt=0, allow_inf_nan=False)
    momentum: float = Field(0.9, ge=0, lt=1, allow_inf_nan=False)
    weight_decay: float = Field(5e-4, ge=0, allow_inf_nan=False)
    clip: float | None = Field(10.0, gt=0, allow_inf_nan=False)

    @field_validator("lr", "weight_decay", "clip")
    @classmethod
    def _finite_in_float32(cls, value: float | None) -> float | None:
        if value is not None and abs(value) > FLOAT32_MAX:
            raise ValueError(f"{value:g} is not finite in float32 (at most 3.4e38)")
        return value


class Groups(Strict):
    """Many / medium / few classes by their global training count (SPEC §5).

    ``count`` (default): many > ``many_above`` (100), few < ``few_below`` (20), medium otherwise.
    ``share`` (Fed-GraB): classes sorted by count; many = the head holding the first
    ``many_share`` (75%) of the samples, medium = up to ``medium_share`` (95%), few = the rest.
    """

    rule: Literal["count", "share"] = "count"
    many_above: int = Field(100, ge=0)
    few_below: int = Field(20, ge=0)
    many_share: float = Field(0.75, gt=0, lt=1, allow_inf_nan=False)
    medium_share: float = Field(0.95, gt=0, le=1, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> "Groups":
        if self.few_below > self.many_above + 1:  # otherwise a class could be both many and few
            raise ValueError(f"few_below ({self.few_below}) must be at most many_above + 1 ({self.many_above + 1})")
        if self.medium_share <= self.many_share:
            raise ValueError(f"medium_share ({self.medium_share}) must exceed many_share ({self.many_share})")
        return self


class Faults(Strict):
    """The round policy (docs/faults.md): how many of the sampled clients must return, by when,
    and what a failed client does."""

    min_results: Annotated[int, Field(ge=1, strict=True)] | Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = \
        Field(1, description="sampled clients that must return for the round to be applied: a count "
                             "(an integer >= 1; default 1) or a share (a float in (0, 1]; 1.0: all of them)")
    round_timeout: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="deadline of a round in seconds: a client past it is dropped as late (the "
                          "availability's simulated clock; on Flower, also the wait for replies)")
    on_failure: Literal["stop", "drop"] = Field(
        "stop", description="a client that fails or is late: stop the run with its error (stop), or leave it "
                            "out of the round (drop)")
    on_short: Literal["skip", "stop"] = Field(
        "skip", description="a round in which fewer than min_results clients return: skip it (the global model "
                            "and server state stay as they were, the row says why, the run goes on) or stop the "
                            "run (the last complete round is checkpointed)")

    def required(self, sampled: int) -> int:
        """How many of ``sampled`` clients must return."""
        if isinstance(self.min_results, int):
            return min(self.min_results, sampled)
        return max(1, math.ceil(self.min_results * sampled - 1e-9))


class RunConfig(Strict):
    # data
    dataset: str = Field("mnist", description="a registered dataset, or its spec with parameters, e.g. "
                         "'imagefolder(image_size=96)' (docs/datasets.md)")
    data_root: Path | None = None
    download: bool = False
    train_limit: PositiveInt | None = Field(None, description="use only the first N training samples")
    augment: list[dict[str, Any]] = Field(default_factory=list, description="training-time augmentation, e.g. "
                                          "'random_crop(padding=4) + hflip' (docs/augmentation.md)")
    test_limit: PositiveInt | None = Field(None, description="use only the first N test samples")
    # partition
    partition: dict[str, Any] = Field(default_factory=lambda: dict(DEFAULT_PARTITION))
    partition_file: Path | None = None
    clients: PositiveInt = 100
    new_clients: int = Field(0, ge=0, le=10**6, description="clients held out of training from the start: the "
                             "partition has clients + new_clients parts, the last new_clients are never sampled and "
                             "are evaluated apart (new_clients_* fields; docs/evaluation.md)")
    # model
    model: str = "alexnet"
    split: str | None = Field("s2", description="cut point for split algorithms (alexnet: s1..s5)")
    # algorithm and its parameters (e.g. loss, client_loss, server_loss, aggregator)
    algorithm: str = "scala"
    algorithm_params: dict[str, Any] = Field(default_factory=dict)
    # schedule
    # Upper bounds (docs/runs.md, "Bounds"): far beyond any published setting, low enough that a
    # typo (an extra zero or three) is refused instead of running for weeks.
    rounds: PositiveInt = Field(25, le=MAX_ROUNDS,
                                description="communication rounds (default: fits 3 minutes of SCALA on MNIST on 2 CPU cores)")
    participation: float = Field(0.1, gt=0, le=1, allow_inf_nan=False,
                                 description="fraction r of clients sampled per round")
    server_batch: PositiveInt = Field(320, le=MAX_BATCH, description="B: the server's batch; client k takes B_k ∝ |D_k|")
    local_iters: PositiveInt = Field(5, le=MAX_LOCAL_ITERS, description="T local iterations per round")
    local_epochs: PositiveInt | None = Field(None, le=MAX_LOCAL_EPOCHS,
                                             description="epoch-based local training (FedAvg family)")
    batch_size: PositiveInt = Field(64, le=MAX_BATCH, description="minibatch size for epoch-based local training")
    drop_last: bool = Field(False, description="epoch-based local training: leave out each epoch's last partial "
                            "batch (PyTorch's DataLoader(drop_last=True), as PFLlib and FedVLS's code); a client "
                            "smaller than one batch still trains its one batch")
    optimiser: Optimiser = Field(default_factory=Optimiser)
    seeds: Seeds = Field(default_factory=Seeds)
    # execution and output
    device: str = "cpu"
    fused: Literal["auto", "on", "off"] = Field("auto", description="fused loss path: auto (Triton on CUDA, the CPU "
                                               "path where measured faster), on, off (reference); docs/fused.md")
    # -- GPU execution (issue 34, docs/gpu.md) --
    precision: Literal["fp32", "bf16"] = Field("fp32", description="fp32, or bf16: autocast for the forward, the "
                                               "loss in float32, float32 master weights and aggregation (docs/gpu.md)")
    cohort: PositiveInt = Field(1, le=1024, description="FedAvg family: train N participants' local steps together "
                                "as one vmapped step over stacked weights (1: one after another; docs/gpu.md)")
    compile: bool = Field(False, description="FedAvg family: the model's forward and backward of every local step "
                          "through torch.compile (CUDA graphs on CUDA); off by default: on the CPU it costs seconds "
                          "of compilation a run (docs/gpu.md#compiled-steps)")
    graphs: bool = Field(False, description="FedAvg family on CUDA: each client's local step (forward, loss, backward, "
                         "clip, optimiser) captured once per batch shape as a CUDA graph and replayed; with --cohort N the "
                         "cohort's vmapped step, once per group size and batch shape; elsewhere the steps run "
                         "eagerly, said; with --compile the compiled kernels inside the captured step "
                         "(docs/gpu.md#whole-step-cuda-graphs)")
    availability: dict[str, Any] = Field(default_factory=lambda: {"name": "always"},
                                         description="client availability spec: always, bernoulli(p=...), "
                                                     "markov(p_on=..., p_off=...), straggler(...), scripted(...)")
    faults: Faults = Field(default_factory=Faults, description="the round policy: min_results, round_timeout, "
                                                                "on_failure")
    engine: str = Field("local", description="a registered engine: local (this process), flower (Flower's "
                        "simulation runtime, a SuperNode per client: docs/flower.md), or a plugin's")
    workers: int | Literal["auto"] = Field(1, description="processes training the clients (local engine): "
                                                    "1 (this process), N, or auto (the cores); docs/parallel.md")

    # -- uploads, privacy, secure aggregation (issue 42: docs/transforms.md, docs/privacy.md) --
    upload: list[dict[str, Any]] = Field(default_factory=list, description="update transforms each client applies to "
                                         "its update before uploading, e.g. 'clip(norm=1.0) + topk(fraction=0.01, "
                                         "error_feedback=true)' (fedlt list transforms)")
    privacy: dict[str, Any] | None = Field(None, description="differential privacy: "
                                           "'client_level(clip=1.0, noise_multiplier=1.1)' (central noise at the "
                                           "server), 'local(clip=..., noise_multiplier=...)' or 'sample_level(clip=..., "
                                           "noise_multiplier=...)' (DP-SGD; docs/privacy.md)")
    delta: float | None = Field(None, gt=0, lt=1, allow_inf_nan=False,
                                description="δ of the reported ε (default K^-1.1 for K clients)")
    target_epsilon: float | None = Field(None, gt=0, allow_inf_nan=False,
                                         description="calibrate the noise multiplier so that ε after all rounds is "
                                                     "at most this (dp-accounting)")
    secure_aggregation: bool = Field(False, description="pairwise additive masking of the uploads (Bonawitz et al. "
                                     "2017): the server reads only their sum; on engine flower, Flower's SecAgg+")
    stop_at_epsilon: float | None = Field(None, gt=0, allow_inf_nan=False,
                                          description="the privacy budget: the run stops before the round whose ε "
                                                      "would exceed it (docs/privacy.md)")

    @model_validator(mode="after")
    def _budget_needs_a_mechanism(self) -> "RunConfig":
        if self.stop_at_epsilon is not None and self.privacy is None:
            raise ValueError("stop_at_epsilon: needs a --privacy mechanism (client_level, local or sample_level)")
        return self

    @model_validator(mode="after")
    def _secure_aggregation_engine(self) -> "RunConfig":
        """On Flower, secure aggregation is Flower's SecAgg+ (fedlt.flower.secaggplus): one masked
        upload per participant, two or more participants a round."""
        if not (self.secure_aggregation and self.engine == "flower"):
            return self
        if hasattr(fedlt.algorithms.create(self.algorithm, **self.algorithm_params), "open_session"):
            raise ValueError(f"secure_aggregation: algorithm {self.algorithm!r} trains in split-learning sessions (a "
                             "message per local iteration), which Flower's SecAgg+ (one masked upload a participant) "
                             "cannot carry; use engine 'local'")
        if max(int(round(self.participation * self.clients)), 1) < 2:
            raise ValueError("secure_aggregation: Flower's SecAgg+ needs 2 or more participants a round "
                             f"(participation × clients = {self.participation:g} × {self.clients})")
        return self

    @field_validator("upload", mode="before")
    @classmethod
    def _upload_chain(cls, value: Any) -> Any:
        """A chain as on the CLI ("clip(norm=1) + topk(fraction=0.01)") or a list of specs, each checked."""
        try:
            specs = fedlt.transforms.parse_chain(value, "upload") if isinstance(value, str) else value
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        for spec in specs if isinstance(specs, list) else []:
            if isinstance(spec, dict):  # anything else: pydantic names the field
                _check_component(fedlt.transforms.REGISTRY, spec, "upload")
        return specs

    @field_validator("privacy", mode="before")
    @classmethod
    def _privacy_spec(cls, spec: Any) -> Any:
        try:
            return None if spec is None or spec in ("", "none") else fedlt.privacy.mechanism(spec).spec()
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        except ValidationError as exc:
            raise ValueError(f"{parse_spec(spec, 'privacy')['name'] if isinstance(spec, str) else spec.get('name')}: "
                             f"{describe(exc)}") from None

    loader_workers: int = Field(0, ge=0, le=64, description="DataLoader processes decoding images read from files "
                                "(imagefolder) ahead of training and evaluation; 0: in the training process")
    threads: int | None = Field(None, ge=1, le=MAX_THREADS, description="torch intra-op threads of the process running "
                                "the rounds (float reductions split by thread round differently); none: the "
                                "process's own count, recorded in config.json when the run starts (docs/runs.md)")

    @field_validator("workers", mode="before")
    @classmethod
    def _worker_count(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):  # compared, never printed whole
            if not 1 <= value <= MAX_WORKERS:
                raise ValueError(f"must be a number of processes from 1 to {MAX_WORKERS} (or 'auto'), got "
                                 f"{value if abs(value) < 10**12 else f'about 1e{int(value.bit_length() * 0.30103)}'}")
            return value
        text = str(value).strip() if isinstance(value, str) else None
        if text == "auto":
            return text
        got = repr(value) if text is None or len(text) <= 40 else repr(f"{text[:37]}...")
        # ASCII digits only ('²' is a digit to str.isdigit, not to int), its length checked before
        # int() reads it: "1" * 5000 is refused by its size
        if text is None or not (text.isascii() and text.isdigit()) or not text.strip("0"):
            raise ValueError(f"must be a number of processes (1 or more) or 'auto', got {got}")
        if len(text.lstrip("0")) > len(str(MAX_WORKERS)) or int(text) > MAX_WORKERS:
            raise ValueError(f"must be a number of processes from 1 to {MAX_WORKERS} (or 'auto'), got {got}")
        return int(text)

    @model_validator(mode="after")
    def _availability_fits_the_run(self) -> "RunConfig":
        """Scripted faults naming a client this run does not have are refused (the availability's
        ``check_run``), now that ``clients`` is known; rounds beyond ``rounds`` are refused for a
        new run by ``fedlt run`` (a run cut early and resumed with more rounds keeps them)."""

        availability = create_from_spec(fedlt.availability.REGISTRY, self.availability, "availability")
        try:
            availability.check_run(self.clients)
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        return self

    eval_every: PositiveInt = Field(5, description="evaluate every N rounds (and after the last)")
    groups: Groups = Field(default_factory=Groups, description="rule for many / medium / few classes")
    client_test: dict[str, Any] | None = Field(
        None, description="each client's own test set (spec): matched, 'matched(size=50)' (drawn from the test set "
                          "to follow its training labels) or 'holdout(fraction=0.25)' (carved out of its own data "
                          "before training); docs/evaluation.md")
    client_eval: bool | list[dict[str, Any]] = Field(
        False, description="per-client evaluation: true (each client's expected accuracy under its training labels, "
                           "docs/runs.md), or modes (a spec or a list): expected, global_local, personal, "
                           "'finetune(epochs=1)' (docs/evaluation.md)")
    client_eval_fraction: float = Field(1.0, gt=0, le=1, allow_inf_nan=False,
                                        description="share of the clients given the per-client evaluation modes (a "
                                                    "fixed sample per sampling seed; for runs of 1000 clients)")
    posthoc: list[str | dict[str, Any]] = Field(
        default_factory=list, description="post-hoc calibrations evaluated beside the model, e.g. ['tau_norm']")
    checkpoint_every: PositiveInt = Field(1, description="save a checkpoint every N rounds (and on SIGINT/SIGTERM)")
    # the client-state store (fedlt.algorithms.client_states): above this many MiB of per-client state it
    # keeps one file per client under out/client_states and checkpoints only what changed (docs/runs.md)
    client_state_memory_mb: float = Field(512.0, ge=0, le=2**20, allow_inf_nan=False,
                                          description="MiB of client states kept in memory; above: one file per client")
    eval_batch: PositiveInt = Field(2048, le=MAX_BATCH)
    out: Path = Path("runs/latest")
    # -- the authors' settings (issue 41, fedlt.algorithms.authors) --
    preset: Literal["authors"] | None = Field(None, description="authors: the algorithm's authors' training settings "
                                              "(optimiser, local epochs, batch size, drop_last, constants) for every "
                                              "one not set explicitly (fedlt list algorithms NAME shows them)")
    preset_settings: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="what the preset chose (filled in by fedlt): {key: {value, source}}")

    @model_validator(mode="before")
    @classmethod
    def _authors_preset(cls, data: Any) -> Any:
        """``preset = "authors"``: the algorithm's authors' settings fill every key the data does not
        set (a flag, a config file's value), and the ones chosen are recorded in ``preset_settings``
        (kept as recorded when a run's config.json is read back)."""
        if not isinstance(data, dict) or data.get("preset") != "authors":
            return data
        algorithm = data.get("algorithm", cls.model_fields["algorithm"].default)
        settings = authors_settings(algorithm) if isinstance(algorithm, str) else None
        if settings is None:
            raise ValueError(f"preset: {algorithm!r} has no authors' settings: {why_none(algorithm)} (those that "
                             f"have: {', '.join(sorted(AUTHORS))})")
        filled, chosen = fill(data, settings)
        if "preset_settings" not in data:
            filled["preset_settings"] = chosen
        return filled

    @model_validator(mode="before")
    @classmethod
    def _current_format(cls, data: Any) -> Any:
        """A run's config.json as it was written (``format_version`` and all) reads as this
        version's settings: ``RunConfig.model_validate(json.load(f))`` works for every version."""
        if isinstance(data, dict) and "format_version" in data:
            try:
                return upgrade_config(data, "config")
            except FedltError as exc:
                raise ValueError(str(exc)) from None
        return data

    @model_validator(mode="before")
    @classmethod
    def _bounded_nesting(cls, data: Any) -> Any:
        # pydantic and the components' validators walk nested tables recursively
        depth = data_depth(data)
        if depth > MAX_DEPTH:
            raise ValueError(f"the settings are nested {depth} levels deep, more than the {MAX_DEPTH} allowed")
        return data

    @field_validator("partition", mode="before")
    @classmethod
    def _partition_spec(cls, spec: Any) -> Any:
        """A spec string (``"dirichlet(beta=0.1)"``), as ``model`` is written; a ``then`` written
        as a spec string inside a table is read the same way."""
        return _spec_strings(spec, "partition", ("then",))

    @field_validator("algorithm_params", mode="before")
    @classmethod
    def _aggregator_spec(cls, params: Any) -> Any:
        """``aggregator = "fedadam(eta=0.01)"``: a spec string, like ``partition`` and ``model``."""
        return _spec_strings(params, "algorithm_params", ("aggregator",), whole=False)

    @field_validator("out", mode="before")
    @classmethod
    def _named_out(cls, out: Any) -> Any:
        if isinstance(out, str) and not out.strip():  # Path("") is the current directory
            raise ValueError("must name a directory (got an empty string)")
        return out

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, spec: str) -> str:
        """A dataset spec (``mnist``, ``imagefolder(image_size=96)``): the name is checked (with the
        valid names and a suggestion) and its parameter names; their values when it is loaded."""
        try:
            fedlt.datasets.parse(spec)
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        return spec

    @field_validator("algorithm")
    @classmethod
    def _known_algorithm(cls, name: str) -> str:
        fedlt.algorithms.get(name)
        return name

    @field_validator("partition")
    @classmethod
    def _valid_partition(cls, spec: dict[str, Any]) -> dict[str, Any]:
        return _check_component(fedlt.partitioners.REGISTRY, spec, "partition")

    @field_validator("client_test", mode="before")
    @classmethod
    def _client_test_spec(cls, spec: Any) -> Any:
        return _spec_strings(spec, "client_test", (), example=f"e.g. 'holdout(fraction=0.25)' or 'matched' (valid: "
                             f"{', '.join(fedlt.client_tests.REGISTRY.list())})")

    @field_validator("client_test")
    @classmethod
    def _valid_client_test(cls, spec: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if spec is None else _check_component(fedlt.client_tests.REGISTRY, spec, "client_test")

    @field_validator("client_eval", mode="before")
    @classmethod
    def _client_eval_modes(cls, value: Any) -> Any:
        """``true`` / ``false`` as they were; a mode spec or a list of them as ``{"name": ...}``
        tables, each checked; ``expected`` alone is ``true`` (so older configs read the same)."""
        if isinstance(value, bool) or value is None:
            return bool(value)
        specs = [value] if isinstance(value, (str, dict)) else value
        if not isinstance(specs, list):
            return value  # pydantic names the type
        modes = []
        for spec in specs:
            spec = _spec_strings(spec, "client_eval", (), example=f"e.g. 'personal' or 'finetune(epochs=5)' (valid: "
                                 f"expected, {', '.join(EVAL_MODES)})")
            if not isinstance(spec, dict) or spec.get("name") not in ("expected", *EVAL_MODES):
                name = spec.get("name") if isinstance(spec, dict) else spec
                raise ValueError(f"unknown mode {name!r} (valid: expected, {', '.join(EVAL_MODES)})")
            if spec["name"] != "expected":
                try:
                    spec = {"name": spec["name"], **eval_mode_of(spec).params()}
                except FedltError as exc:
                    raise ValueError(str(exc)) from None
            elif len(spec) > 1:
                raise ValueError("expected takes no parameters")
            if any(m["name"] == spec["name"] for m in modes):
                raise ValueError(f"{spec['name']} is given twice")
            modes.append(spec)
        return True if [m["name"] for m in modes] == ["expected"] else modes if modes else False

    @model_validator(mode="after")
    def _parts_fit(self) -> "RunConfig":
        """The parts' declared needs of the classifier (a head, a server step, a personal model)
        against what it provides (fedlt.algorithms.compatibility), before anything is written."""
        algorithm = fedlt.algorithms.create(self.algorithm, **self.algorithm_params)
        try:
            compatibility.check(self.algorithm, algorithm, [m["name"] for m in self.client_eval_modes()])
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        self._server_sees_what_it_reads(algorithm)
        return self

    def _server_sees_what_it_reads(self, algorithm: Any) -> None:
        """Secure aggregation and central client-level DP hand the server only the participants'
        weighted mean (fedlt.uploads): an algorithm that reads each client's own update would run
        silently as something else, so it is refused."""
        central = self.privacy is not None and fedlt.privacy.mechanism(self.privacy).central
        reason = getattr(algorithm, "reads_each_update", lambda: None)()
        if reason and (self.secure_aggregation or central):
            field = "secure_aggregation" if self.secure_aggregation else "privacy"
            raise ValueError(f"{field}: the server then sees only the participants' mean update, but algorithm "
                             f"{self.algorithm!r} needs each one: {reason}; use --privacy local(...) or "
                             "sample_level(...) without secure aggregation, or another algorithm/aggregator")

    @model_validator(mode="after")
    def _client_tests_for_the_modes(self) -> "RunConfig":
        if self.client_eval_modes() and self.client_test is None:
            raise ValueError(f"client_eval: {', '.join(m['name'] for m in self.client_eval_modes())} tests each "
                             "client on its own test set: choose one with client_test (e.g. --client-test matched "
                             "or 'holdout(fraction=0.25)')")
        return self

    @model_validator(mode="after")
    def _new_clients_are_evaluated(self) -> "RunConfig":
        if self.new_clients and not (self.client_eval_expected() or self.client_eval_modes()):
            raise ValueError(f"new_clients: the {self.new_clients} new client(s) never train and are only evaluated: "
                             "set client_eval (true, or modes such as finetune with client_test)")
        return self

    @property
    def partition_clients(self) -> int:
        """Clients in the partition: the ``clients`` that train, then the ``new_clients`` that never do."""
        return self.clients + self.new_clients

    def client_eval_modes(self) -> list[dict[str, Any]]:
        """The per-client evaluation modes (SPEC §7) asked for: ``{"name": ..., **params}`` each."""
        return [] if isinstance(self.client_eval, bool) else [m for m in self.client_eval if m["name"] != "expected"]

    def client_eval_expected(self) -> bool:
        """Whether each client's expected accuracy under its training labels is reported."""
        return self.client_eval is True or (isinstance(self.client_eval, list)
                                            and any(m["name"] == "expected" for m in self.client_eval))

    @field_validator("augment", mode="before")
    @classmethod
    def _augment_spec(cls, spec: Any) -> Any:
        if isinstance(spec, str):  # "random_crop(padding=4) + hflip", as on the CLI
            try:
                return fedlt.augment.parse_augment(spec, "augment")
            except FedltError as exc:
                raise ValueError(str(exc)) from None
        return spec

    @field_validator("augment")
    @classmethod
    def _valid_augment(cls, specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for spec in specs:
            _check_component(fedlt.augment.REGISTRY, spec, "augment")
        return specs

    @field_validator("availability", mode="before")
    @classmethod
    def _availability_spec(cls, spec: Any) -> Any:
        if isinstance(spec, str):  # a spec string, as on the CLI
            try:
                return parse_spec(spec, "availability")
            except FedltError as exc:
                raise ValueError(str(exc)) from None
        return spec

    @field_validator("availability")
    @classmethod
    def _valid_availability(cls, spec: dict[str, Any]) -> dict[str, Any]:
        return _check_component(fedlt.availability.REGISTRY, spec, "availability")

    @field_validator("posthoc")
    @classmethod
    def _valid_posthoc(cls, specs: list[str | dict[str, Any]]) -> list[str | dict[str, Any]]:
        for spec in specs:
            spec = {"name": spec} if isinstance(spec, str) else spec
            if "name" not in spec:
                raise ValueError(f"a posthoc entry needs a 'name' (valid: {', '.join(fedlt.posthoc.list())})")
            params = {k: v for k, v in spec.items() if k != "name"}
            try:  # names checked here; values when it is first applied to the model
                inspect.signature(fedlt.posthoc.get(spec["name"])).bind(None, **params)
            except TypeError as exc:
                raise ValueError(f"{spec['name']}: {exc}") from None
        return specs

    @field_validator("partition_file")
    @classmethod
    def _existing_partition_file(cls, path: Path | None) -> Path | None:
        if path is not None and not Path(path).is_file():
            raise ValueError(f"no file at {path}")
        return path

    @field_validator("model")
    @classmethod
    def _known_model(cls, spec: str) -> str:
        """A model spec (``mlp``, ``timm:resnet18``, ``my_net(width=64)``): the name is checked, and
        a registered model's parameters against its signature (nothing is built here)."""
        try:
            name, params = fedlt.models.parse_model(spec)
        except FedltError as exc:
            raise ValueError(str(exc)) from None
        if name.startswith("timm:"):
            if not name.removeprefix("timm:"):
                raise ValueError("'timm:' needs a model name, e.g. timm:resnet18")
            return spec  # timm is slow to import; the engine builds (and checks) the model before training
        factory = fedlt.models.get(name)
        try:
            inspect.signature(factory).bind(**dict.fromkeys(fedlt.models.DATASET_KEYS, 1), **params)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from None
        except ValueError:  # no signature to read (a builtin-like callable): the engine checks
            pass
        return spec

    @field_validator("engine")
    @classmethod
    def _registered_engine(cls, engine: str) -> str:
        if engine not in ENGINES.list():
            raise ValueError(f"unknown engine {engine!r} (registered: {', '.join(ENGINES.list())})")
        return engine

    @field_validator("device")
    @classmethod
    def _valid_device(cls, device: str) -> str:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            raise ValueError(f"{device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
        available = {"cpu": True, "cuda": torch.cuda.is_available(),
                     "mps": getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available()}
        if kind not in available:
            raise ValueError(f"{device!r}: fedlt runs on cpu, cuda or mps")
        if not available[kind]:
            raise ValueError(f"{device!r}: no {kind} device is available here")
        index, count = torch.device(device).index, torch.cuda.device_count() if kind == "cuda" else 1
        if index is not None and index >= count:  # torch accepts any index, and fails at the first tensor (or never, on cpu)
            raise ValueError(f"{device!r}: this machine has {count} {kind} device{'s' if count > 1 else ''} "
                             f"({', '.join(f'{kind}:{i}' for i in range(count))})")
        return device

    @field_validator("algorithm_params")
    @classmethod
    def _valid_algorithm_params(cls, params: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        if "name" in params:
            raise ValueError("the algorithm is chosen by 'algorithm', not by a 'name' among its parameters")
        if "algorithm" in info.data:  # else the algorithm itself is already reported as invalid
            _check_component(fedlt.algorithms.REGISTRY, {"name": info.data["algorithm"], **params}, "algorithm_params")
        return params


# -- format versions (docs/runs.md, "Format versions") -------------------------------------------
# config.json's ``format_version``: 1 (no such key) up to fedlt fdcbc6a; 2 adds the key and
# ``threads`` (and the fields added beside it, each with a default that reproduces version 1).
CONFIG_FORMAT = 2


def _fields_added_in_2(data: dict[str, Any]) -> dict[str, Any]:
    """Version 1 → 2: nothing to rewrite. Every field version 2 added reads as its declared default
    (``with_defaults``), chosen so that a version-1 run continues with the same numbers: ``threads``
    unset (the process's own count, as version 1 always ran), ``new_clients`` 0."""
    return data


# step from version v to v + 1, applied in order to an older file
CONFIG_MIGRATIONS: dict[int, Any] = {1: _fields_added_in_2}


def upgrade_config(data: dict[str, Any], where: Any) -> dict[str, Any]:
    """The settings of a config file (``format_version`` removed) as this fedlt reads them: an
    older version brought forward step by step; a newer one (written by a later fedlt), or a
    version that is not a positive integer, refused in one line naming it."""
    version = data.get("format_version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise FedltError(f"{where}: format_version {version!r} is not a config format fedlt knows "
                         f"(this fedlt reads formats 1 to {CONFIG_FORMAT})")
    if version > CONFIG_FORMAT:
        raise FedltError(f"{where} was written by a newer fedlt (config format {version}); this fedlt reads "
                         f"formats 1 to {CONFIG_FORMAT}: upgrade fedlt to use it")
    data = {k: v for k, v in data.items() if k != "format_version"}
    for step in range(version, CONFIG_FORMAT):
        data = CONFIG_MIGRATIONS[step](data)
    return data


def recorded(config: "RunConfig") -> dict[str, Any]:
    """What a run directory's ``config.json`` holds: the format version and the resolved settings."""
    return {"format_version": CONFIG_FORMAT, **config.model_dump(mode="json")}


_DEFAULTS: dict[type, dict[str, Any]] = {}


def with_defaults(data: dict[str, Any], model: type[BaseModel] | None = None) -> dict[str, Any]:
    """``data`` (a config.json's settings, as JSON) with every field it lacks at its declared
    default, nested tables of settings (``faults``, ``optimiser``, ...) included: how a file written
    before a field existed reads, whatever the field (another component's, a plugin's)."""
    model = model or RunConfig
    if model not in _DEFAULTS:
        _DEFAULTS[model] = model().model_dump(mode="json")
    out = dict(data)
    for name, field in model.model_fields.items():
        if name not in out:
            out[name] = _DEFAULTS[model][name]
        elif isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) \
                and isinstance(out[name], dict):
            out[name] = with_defaults(out[name], field.annotation)
    return out


def read_config_file(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise FedltError(f"config file {path} does not exist")
    if path.is_dir():
        raise FedltError(f"config file {path} is a directory, not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FedltError(f"config file {path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:  # unreadable: permissions, a device, a broken link
        raise FedltError(f"config file {path} could not be read: {exc.strerror or exc}") from None
    if path.suffix not in (".toml", ".yaml", ".yml", ".json"):
        raise FedltError(f"config file {path}: unknown format {path.suffix!r} (use .toml, .yaml, .yml or .json)")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            data = safe_yaml.load(text)  # aliases bounded before expansion
            data = {} if data is None else data  # an empty file
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, ValueError) as exc:
        raise FedltError(f"config file {path} is not valid {path.suffix[1:]}: {exc}".splitlines()[0]) from None
    except RecursionError:
        raise FedltError(f"config file {path} is nested too deeply to be a configuration") from None
    except Exception as exc:  # yaml's errors do not share a base with the others
        raise FedltError(f"config file {path} could not be parsed: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise FedltError(f"config file {path} must hold a table of settings (key = value) at its top level, "
                         f"not a {type(data).__name__}")
    return upgrade_config(data, f"config file {path}")


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge: nested tables (seeds, optimiser, partition) merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
