"""ResNet encoders and heads: every variant trains (gradients, no NaN), widths follow SimCLR/BYOL,
and width-1 weights move both ways with torchvision."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torch import nn

from relicv2.models.heads import MLP, build_networks
from relicv2.models.resnet import load_torchvision_state_dict, resnet, to_torchvision_state_dict
from tests.threads import one_torch_thread


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny convolutions gain nothing from threads, and on a shared CI box OpenMP threads that
    spin-wait for busy cores make them 10-30x slower; restore the setting afterwards."""
    with one_torch_thread():
        yield


@pytest.mark.parametrize("depth, width", [(18, 1), (50, 1), (18, 2)])  # 34 shares 18's BasicBlock path
def test_every_parameter_gets_a_finite_gradient(depth: int, width: int) -> None:
    torch.manual_seed(0)
    model = resnet(depth, width)
    features = model(torch.randn(2, 3, 32, 32))
    assert features.shape == (2, model.num_features)
    assert torch.isfinite(features).all()
    features.square().mean().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        assert torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize(
    "depth, width, features, millions",
    # Parameter counts (without the classifier) as listed in the BYOL paper, Table 1:
    # ResNet-50 1x/2x/4x: 24M/94M/375M, ResNet-200 2x: 250M.
    [(18, 1, 512, None), (34, 1, 512, None), (50, 1, 2048, 24), (50, 2, 4096, 94),
     (50, 4, 8192, 375), (101, 1, 2048, None), (152, 1, 2048, None), (200, 2, 4096, 250)],
)
def test_widths_follow_simclr_byol(depth: int, width: int, features: int, millions: int | None) -> None:
    with torch.device("meta"):  # shapes only: no memory for the 375M-parameter encoder
        model = resnet(depth, width)
    assert model.num_features == features
    assert model.conv1.out_channels == 64 * width  # the stem is widened too
    if millions is not None:
        assert round(sum(p.numel() for p in model.parameters()) / 1e6) == millions


def test_resnet200_layout() -> None:
    with torch.device("meta"):
        model = resnet(200)
    assert [len(stage) for stage in (model.layer1, model.layer2, model.layer3, model.layer4)] == [3, 24, 36, 3]


def test_unsupported_depth_or_width_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="depth 26"):
        resnet(26)
    with pytest.raises(ValueError, match="width 3"):
        resnet(50, 3)


def _randomise_batchnorm(model: nn.Module, seed: int) -> None:
    """Non-trivial BN statistics and affine parameters, so eval-mode outputs test every tensor."""
    g = torch.Generator().manual_seed(seed)
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.copy_(0.1 * torch.randn(module.running_mean.shape, generator=g))
            module.running_var.copy_(0.5 + torch.rand(module.running_var.shape, generator=g))
            module.weight.data.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
            module.bias.data.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


@pytest.mark.parametrize("depth", [18, 50])
def test_torchvision_round_trip(depth: int) -> None:
    torch.manual_seed(depth)
    images = torch.randn(2, 3, 32, 32)
    torchvision_resnet = getattr(torchvision.models, f"resnet{depth}")

    # torchvision -> ours (the classifier's fc.* entries are dropped)
    reference = torchvision_resnet(weights=None)
    _randomise_batchnorm(reference, seed=1)
    ours = resnet(depth)
    load_torchvision_state_dict(ours, reference.state_dict())
    reference.fc = nn.Identity()
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(images), reference.eval()(images))

    # ours -> torchvision
    _randomise_batchnorm(ours, seed=2)
    target = torchvision_resnet(weights=None)
    result = target.load_state_dict(to_torchvision_state_dict(ours), strict=False)
    assert sorted(result.missing_keys) == ["fc.bias", "fc.weight"] and not result.unexpected_keys
    target.fc = nn.Identity()
    with torch.no_grad():
        expected = ours(images)
        torch.testing.assert_close(target.eval()(images), expected)
        assert not torch.allclose(reference(images), expected)  # the second direction moved new weights


def test_mismatched_torchvision_weights_are_a_clear_error() -> None:
    state = torchvision.models.resnet18(weights=None).state_dict()
    with pytest.raises(ValueError, match="missing"):
        load_torchvision_state_dict(resnet(34), state)
    with pytest.raises(ValueError, match="wrong shape"):
        load_torchvision_state_dict(resnet(18, 2), state)
    with pytest.raises(ValueError, match="width-1"):
        to_torchvision_state_dict(resnet(18, 2))


def test_zero_init_residual_makes_blocks_start_as_identity() -> None:
    torch.manual_seed(0)
    model = resnet(50, zero_init_residual=True)
    block = model.layer1[1]  # no projection shortcut: output = relu(x + residual(x))
    x = torch.rand(2, block.conv1.in_channels, 8, 8)
    torch.testing.assert_close(block(x), x)
    plain = resnet(50).layer1[1]
    assert not torch.allclose(plain(x), x)


def test_channels_last_gives_the_same_features() -> None:
    torch.manual_seed(0)
    model = resnet(18).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(images)
        model = model.to(memory_format=torch.channels_last)
        got = model(images.to(memory_format=torch.channels_last))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_mlp_is_linear_bn_relu_linear() -> None:
    head = MLP(8, hidden_dim=16, out_dim=4)
    kinds = [type(m) for m in head.children()]
    assert kinds == [nn.Linear, nn.BatchNorm1d, nn.ReLU, nn.Linear]
    assert head(torch.randn(5, 8)).shape == (5, 4)


def test_build_networks_target_is_a_frozen_copy() -> None:
    torch.manual_seed(0)
    online, target = build_networks(18, 1, hidden_dim=32, out_dim=16)
    images = torch.randn(4, 3, 32, 32)
    assert all(not p.requires_grad for p in target.parameters())
    assert all(p.requires_grad for p in online.parameters())
    with torch.no_grad():
        torch.testing.assert_close(target(images), online.projector(online.encoder(images)))
    assert online(images).shape == (4, 16)
    # A copy, not shared storage: changing the online weights leaves the target alone.
    with torch.no_grad():
        online.encoder.conv1.weight.add_(1.0)
    assert not torch.equal(online.encoder.conv1.weight, target.encoder.conv1.weight)
