"""Splitting models into client and server parts (SPEC §3): fedlt.models.splitting and `fedlt splits`."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # `import timm` imports triton, which wants a GPU otherwise

import copy
import functools
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from fedlt.errors import FedltError
from fedlt.models import build
from fedlt.models.splitting import SPLITTERS, SplitPoint, cut_points, find_splitter, split, split_points

TIMM_MODELS = {
    # name -> the splitter that must handle it
    "timm:resnet18": "timm_sequential",
    "timm:mobilenetv2_100": "timm_sequential",
    "timm:efficientnet_b0": "timm_sequential",
    "timm:convnext_atto": "timm_sequential",
    "timm:vit_tiny_patch16_224": "timm_vit",  # img_size=32, patch 16: 4 patches + the class token
}


@functools.cache
def model(name: str) -> nn.Module:
    torch.manual_seed(0)
    net = build(name, in_chans=3, num_classes=10, image_size=32).eval()
    # Random BatchNorm statistics: the fresh ones (0, 1) would hide a part that skips a BN layer.
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
    return net


@functools.cache
def points(name: str) -> list[SplitPoint]:
    return split_points(model(name), torch.zeros(1, 3, 32, 32))


def inputs() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


@functools.cache
def full_output(name: str) -> torch.Tensor:
    with torch.no_grad():
        return model(name)(inputs())


def names(module: nn.Module) -> tuple[set[str], set[str]]:
    return {n for n, _ in module.named_parameters()}, {n for n, _ in module.named_buffers()}


def assert_exact_split(net, client, server, x, point=None, expected=None, shared=True) -> torch.Tensor:
    net.eval(), client.eval(), server.eval()
    with torch.no_grad():
        expected = net(x) if expected is None else expected
        activation = client(x)
        got = server(activation)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if point is not None:
        assert tuple(activation.shape[1:]) == point.activation_shape
    (cp, cb), (sp, sb), (mp, mb) = names(client), names(server), names(net)
    assert not cp & sp and cp | sp == mp, "parameter names must be disjoint and cover the model"
    assert not cb & sb and cb | sb == mb, "buffer names must be disjoint and cover the model"
    # The parts hold the model's tensors themselves, not copies.
    own = dict(net.named_parameters()) | dict(net.named_buffers())
    for part in (client, server) if shared else ():
        for n, t in [*part.named_parameters(), *part.named_buffers()]:
            assert t is own[n]
    assert set(client.state_dict()) | set(server.state_dict()) == set(net.state_dict())
    return activation


# -- timm families --------------------------------------------------------------------------


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_family_uses_its_splitter_and_feature_info(name):
    net = model(name)
    assert type(find_splitter(net)).__name__ == type(SPLITTERS.get(TIMM_MODELS[name])).__name__
    modules = [fi["module"] for fi in net.feature_info]
    assert [p.module for p in points(name)] == modules  # the cut index is the feature_info index
    assert [p.index for p in points(name)] == list(range(len(modules)))
    total = sum(p.numel() for p in net.parameters())
    for p in points(name):
        assert p.client_params + p.server_params == total and p.client_params > 0 and p.server_params > 0
    client_sizes = [p.client_params for p in points(name)]
    assert client_sizes == sorted(client_sizes) and len(set(client_sizes)) == len(client_sizes)


def timm_activation_shape(name: str, index: int) -> tuple[int, ...]:
    """What cut ``index`` sends for a 3x32x32 input, from timm's own description of the model
    (not from the splitter): ``feature_info``'s channels and reduction for the CNNs' stage/block
    cuts, (class token + 2x2 patches, embed_dim) for the ViT."""
    if name == "timm:vit_tiny_patch16_224":
        return (1 + (32 // 16) ** 2, 192)
    info = model(name).feature_info[index]
    side = 32 // info["reduction"]
    return (info["num_chs"], side, side)


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_reported_activation_shapes_match_timm_feature_info(name):
    """split_points (and so `fedlt splits`, checked against it below) reports timm's shapes."""
    assert [p.activation_shape for p in points(name)] == [
        timm_activation_shape(name, i) for i in range(len(model(name).feature_info))
    ]


@pytest.mark.parametrize("name", TIMM_MODELS)
@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_timm_split_is_exact_disjoint_and_covering(name, data):
    index = data.draw(st.integers(0, len(points(name)) - 1), label="cut")
    net = model(name)
    client, server = split(net, index)
    activation = assert_exact_split(net, client, server, inputs(), points(name)[index], full_output(name))
    # The client's real output (batch 2, random input) against timm's description of the model.
    assert tuple(activation.shape) == (2, *timm_activation_shape(name, index))


@pytest.mark.parametrize("name", ["timm:resnet18", "timm:vit_tiny_patch16_224"])
def test_split_backward_gives_the_models_gradients(name):
    """Training through the parts is training the model: same gradients, in train mode."""
    net = copy.deepcopy(model(name))  # train-mode forwards move BN statistics: keep the cached model
    x, y = inputs(), torch.tensor([1, 7])
    net.train()
    net.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    client, server = split(net, 2)
    client.train(), server.train()
    net.zero_grad()
    activation = client(x)
    sent = activation.detach().requires_grad_()  # what crosses the network
    nn.functional.cross_entropy(server(sent), y).backward()
    activation.backward(sent.grad)
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], atol=1e-6, rtol=1e-4)


def test_vit_class_token_travels_with_the_activation():
    net = model("timm:vit_tiny_patch16_224")
    client, server = split(net, 0)
    cp, _ = names(client)
    assert {"cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.attn.qkv.weight"} <= cp
    assert {"norm.weight", "head.weight", "blocks.1.attn.qkv.weight"} <= names(server)[0]
    assert points("timm:vit_tiny_patch16_224")[0].activation_shape == (1 + 4, 192)


def test_parts_share_storage_with_the_model():
    """Changing a client parameter (as an optimiser or averaging would) changes the model."""
    net = build("timm:resnet18", in_chans=3, num_classes=10, image_size=32).eval()
    client, server = split(net, "layer1")
    x = inputs()
    with torch.no_grad():
        before = net(x)
        # (not a conv inside a block: timm zero-initialises each block's last BN weight)
        client.get_parameter("conv1.weight").add_(0.1)
        assert not torch.allclose(net(x), before)
        server.get_parameter("fc.bias").add_(1.0)
        torch.testing.assert_close(server(client(x)), net(x), atol=1e-5, rtol=0)
    assert client.get_parameter("conv1.weight").data_ptr() == net.conv1.weight.data_ptr()


@pytest.mark.parametrize("name", ["timm:resnet18", "timm:vit_tiny_patch16_224"])
def test_a_deep_copied_part_is_independent_and_still_exact(name):
    """Per-client copies (SplitFed's server copies) may be made with copy.deepcopy."""
    net = model(name)
    client, server = split(net, 1)
    client_copy, server_copy = copy.deepcopy(client), copy.deepcopy(server)
    assert_exact_split(net, client_copy, server_copy, inputs(), expected=full_output(name), shared=False)
    weight = next(iter(server_copy.parameters()))
    assert all(weight is not p for p in net.parameters())
    with torch.no_grad():
        weight.add_(1.0)
        torch.testing.assert_close(net(inputs()), full_output(name), atol=0, rtol=0)


def test_batchnorm_statistics_live_on_the_side_of_their_layer():
    """Train-mode client forwards update the model's running statistics of the client's BN layers
    (they are buffers of the client) and leave the server's alone."""
    net = build("timm:resnet18", in_chans=3, num_classes=10, image_size=32)
    client, server = split(net, "layer1")
    cb, sb = names(client)[1], names(server)[1]
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked", "layer1.0.bn1.running_mean"} <= cb
    assert {"layer2.0.bn1.running_mean", "layer4.1.bn2.running_var"} <= sb
    assert "bn1.running_mean" in client.state_dict() and "bn1.running_mean" not in server.state_dict()
    server_stats = net.layer2[0].bn1.running_mean.clone()
    client.train()
    client(inputs())
    assert int(net.bn1.num_batches_tracked) == 1 and net.bn1.running_mean.abs().sum() > 0
    assert torch.equal(net.layer2[0].bn1.running_mean, server_stats)
    # Averaging a client state_dict into the model (as FedAvg of client sides does) needs no renaming.
    state = {k: v.clone() for k, v in client.state_dict().items()}
    state["bn1.running_mean"].fill_(3.0)
    net.load_state_dict(state, strict=False)
    assert torch.all(net.bn1.running_mean == 3.0)


def test_server_eval_mode_reaches_the_owners_head():
    """timm's forward_head reads the model's own training flag (for dropout)."""
    net = build("timm:resnet18", in_chans=3, num_classes=10, image_size=32)
    net.drop_rate = 0.5
    net.eval()
    client, server = split(net, "layer4")  # the server is pooling + fc: only dropout depends on the mode
    server.train()
    x = inputs()
    with torch.no_grad():
        a = client(x)
        torch.manual_seed(0)
        noisy = server(a)
        server.eval()
        torch.testing.assert_close(server(a), net(x), atol=1e-5, rtol=0)
    assert not torch.allclose(noisy, net(x))


def test_cut_by_index_string_or_name():
    net = model("timm:resnet18")
    by_int, by_str, by_name = split(net, 2), split(net, "2"), split(net, "layer2")
    assert names(by_int[0]) == names(by_str[0]) == names(by_name[0])
    assert "layer2.1.conv2.weight" in names(by_int[0])[0] and "layer3.0.conv1.weight" in names(by_int[1])[0]


@pytest.mark.parametrize("at", [5, -1, "9", "layer9", "s2", 2.0, None])
def test_invalid_cut_names_the_valid_ones(at):
    with pytest.raises(FedltError, match=r"valid: 0=act1, 1=layer1, 2=layer2, 3=layer3, 4=layer4"):
        split(model("timm:resnet18"), at)


# -- AlexNet (its own split points) ------------------------------------------------------------


@pytest.mark.parametrize("in_chans,size", [(3, 32), (1, 28)])
@pytest.mark.parametrize("at", ["s1", "s2", "s3", "s4", "s5"])
def test_alexnet_split_points(at, in_chans, size):
    net = build("alexnet", in_chans=in_chans, num_classes=10, image_size=size).eval()
    client, server = split(net, at)
    x = torch.randn(2, in_chans, size, size)
    assert_exact_split(net, client, server, x)
    kept = {"s1": 3, "s2": 6, "s3": 7, "s4": 11, "s5": 13}[at]  # SPEC §3: client layers
    assert {n.split(".")[0] for n in client.state_dict()} <= {str(i) for i in range(kept)}
    assert {n.split(".")[0] for n in server.state_dict()} <= {str(i) for i in range(kept, 14)}


def test_alexnet_split_points_table():
    net = build("alexnet", in_chans=3, num_classes=10, image_size=32)
    table = split_points(net, torch.zeros(1, 3, 32, 32))
    assert [(p.name, p.module, p.activation_shape) for p in table] == [
        ("s1", "2", (32, 16, 16)), ("s2", "5", (64, 8, 8)), ("s3", "6", (128, 8, 8)),
        ("s4", "10", (256, 3, 3)), ("s5", "12", (512,)),
    ]
    assert [p.name for p in table] == [n for n, _ in cut_points(net)]
    with pytest.raises(FedltError, match="valid: 0=s1, 1=s2, 2=s3, 3=s4, 4=s5"):
        split(net, "s6")
    assert names(split(net, 1)[0]) == names(split(net, "s2")[0])


# -- torch.fx fallback ---------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)) + x)


class Custom(nn.Module):
    """Traceable but of no known family: a residual stage, a free parameter read by get_attr,
    a module the forward never calls, and a flatten + linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.stage = nn.Sequential(Residual(8), Residual(8))
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.unused = nn.Linear(2, 2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stage(self.stem(x)) * self.scale
        return self.fc(torch.flatten(self.pool(x), 1))


def test_fx_fallback_cuts_only_where_one_value_crosses():
    net = Custom().eval()
    assert type(find_splitter(net)).__name__ == "FxSplitter"
    cuts = [name for name, _ in cut_points(net)]
    # Not inside a residual block (its skip would cross too), not after a bare function (flatten:
    # no module ends there) nor after the fc (no server left). `scale` is read only after "stage",
    # so it is the server's.
    assert cuts == ["stem.0", "stem.1", "stem", "stage.0", "stage", "pool"]
    x = inputs()
    for i, p in enumerate(split_points(net, x[:1])):
        client, server = split(net, i)
        assert_exact_split(net, client, server, x, p)
    client, server = split(net, "stage")
    assert "scale" in names(server)[0] and "unused.weight" in names(server)[0]
    with torch.no_grad():
        client.get_parameter("stem.0.bias").add_(1.0)
        torch.testing.assert_close(server(client(x)), net(x), atol=1e-5, rtol=0)


def test_fx_fallback_on_the_mlp():
    net = build("mlp", in_chans=1, num_classes=10, image_size=28).eval()
    x = torch.randn(2, 1, 28, 28)
    table = split_points(net, x[:1])
    # After the first linear layer and every later module but the last; not after the flatten
    # (a client without parameters).
    assert [(p.module, p.activation_shape) for p in table] == [(str(i), (200,)) for i in (1, 2, 3, 4)]
    for p in table:
        assert_exact_split(net, *split(net, p.index), x, p)


def test_fx_fallback_on_a_timm_model_offers_its_feature_info():
    """The fallback for timm families without a splitter: traced with timm's leaf modules and
    cut only at feature_info modules (checked here on resnet18, which has its own splitter)."""
    net, fx = model("timm:resnet18"), SPLITTERS.get("fx")
    modules = [fi["module"] for fi in net.feature_info]
    assert fx.cut_points(net) == [(m, m) for m in modules]
    for i in (0, 2, 4):
        assert_exact_split(net, *fx.split(net, i), inputs(), points("timm:resnet18")[i], full_output("timm:resnet18"))


def test_untraceable_model_is_a_clear_error():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                x = -x
            return self.b(self.a(x))

    with pytest.raises(FedltError, match="cannot be split.*torch.fx cannot trace"):
        split(Branchy(), 0)


def test_levit_splits_exactly_through_fx():
    """LeViT's eval-mode attention caches attention_biases[:, idxs] in a dict keyed by str(device);
    under fx that is "Proxy(getattr_2)" holding a Proxy of the trace, which the next trace (split
    after cut_points) would reuse from the old graph. The fallback keeps Proxies out of such caches."""
    name = "timm:levit_128s"  # fixed_input_size: built with img_size=32 (2x2 tokens after the stem)
    net = model(name)
    assert type(find_splitter(net)).__name__ == "FxSplitter"
    x = inputs()
    with torch.no_grad():
        expected = net(x)  # fills the eval-mode cache with a real tensor first
    table = split_points(net, x[:1])
    assert [(p.name, p.activation_shape) for p in table] == [
        ("stages.0", (4, 128)), ("stages.1", (1, 256)), ("stages.2", (1, 384))
    ]
    for p in table:
        assert_exact_split(net, *split(net, p.index), x, p, expected)
    attention = net.stages[0].blocks[0].attn
    assert all(isinstance(v, torch.Tensor) for v in attention.attention_bias_cache.values())


def test_a_module_caching_a_value_in_an_attribute_is_traced_afresh():
    class Cached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            self.scale = nn.Parameter(torch.full((4,), 1.5))
            self.cache = None

        def forward(self, x):
            h = torch.relu(self.a(x))
            if self.cache is None:
                self.cache = self.scale * 2
            return self.b(h * self.cache)

    net = Cached().eval()
    assert cut_points(net) == [("a", "a")] and net.cache is None  # the trace's Proxy is not kept
    assert_exact_split(net, *split(net, 0), torch.randn(2, 4))


def test_an_unexpected_failure_while_splitting_is_a_fedlt_error():
    """A traceable model the fx splitter trips over (a submodule registered under a dotted name,
    which add_module would refuse) is a one-line FedltError naming the model and the cut, with
    the original exception chained, not a raw KeyError."""

    class Broken(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)
            self._modules["spare.head"] = nn.Linear(4, 2)  # never called

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    net = Broken()
    assert cut_points(net) == [("a", "a")]
    with pytest.raises(FedltError, match=r"^cannot split Broken at 0 \(a\): KeyError: 'spare'$") as err:
        split(net, 0)
    assert isinstance(err.value.__cause__, KeyError)


def test_model_without_a_cut_names_none():
    with pytest.raises(FedltError, match=r"valid: none"):
        split(nn.Sequential(nn.Linear(4, 2)), 0)


# -- the registry ------------------------------------------------------------------------------


def test_a_registered_splitter_takes_precedence_by_priority():
    class Halves:
        priority = 5

        def applies(self, model):
            return isinstance(model, nn.Sequential) and len(model) == 4

        def cut_points(self, model):
            return [("half", "1")]

        def split(self, model, index):
            return model[:2], model[2:]

    net = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 5), nn.Linear(5, 2)).eval()
    assert type(find_splitter(net)).__name__ == "FxSplitter"
    with SPLITTERS.temporary("halves", Halves()):
        assert cut_points(net) == [("half", "1")]
        client, server = split(net, "half")
        x = torch.randn(2, 3)
        torch.testing.assert_close(server(client(x)), net(x))
    assert "halves" not in SPLITTERS.list()


# -- create_timm ---------------------------------------------------------------------------------


def test_create_timm_sizes_the_model_for_the_dataset():
    vit = build("timm:vit_tiny_patch16_224", in_chans=1, num_classes=7, image_size=32)
    assert vit.patch_embed.img_size == (32, 32) and vit.head.out_features == 7
    assert vit(torch.zeros(1, 1, 32, 32)).shape == (1, 7)
    cnn = build("timm:resnet18", in_chans=1, num_classes=3, image_size=28).eval()
    assert cnn.conv1.in_channels == 1 and cnn(torch.zeros(1, 1, 28, 28)).shape == (1, 3)


def test_create_timm_unknown_name_hints_close_matches():
    with pytest.raises(FedltError, match=r"unknown timm model 'resnet81'; did you mean 'resnet18'"):
        build("timm:resnet81", in_chans=3, num_classes=10, image_size=32)


# -- `fedlt splits` ------------------------------------------------------------------------------


def test_splits_command_prints_the_table():
    from typer.testing import CliRunner

    import fedlt.cli.commands  # noqa: F401  (registers the commands)
    from fedlt.cli import app

    result = CliRunner().invoke(app, ["splits", "timm:resnet18", "--dataset", "cifar10"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    table = points("timm:resnet18")  # the same model size: 3x32x32, 10 classes
    for p in table:
        row = next(line for line in lines if line.split()[:2] == [str(p.index), p.name])
        assert "×".join(map(str, p.activation_shape)) in row
        assert f"{p.client_params:,}" in row and f"{p.server_params:,}" in row


def test_splits_command_for_a_dataset_and_user_errors(capsys):
    from fedlt.cli import main

    main(["splits", "alexnet", "--dataset", "mnist"])  # returns normally on success
    out = capsys.readouterr().out
    assert "1x28x28" in out and "64×7×7" in out and "s2" in out
    with pytest.raises(SystemExit) as exit_:
        main(["splits", "alexnet", "--image-size", "20"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and "Traceback" not in err
