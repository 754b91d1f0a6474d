"""DINO's pieces: the DINO, iBOT and KoLeo losses equal lightly's on the same inputs (centers included, over
several steps), Sinkhorn-Knopp equals lightly's SwAV routine and balances the prototypes, the head keeps its
prototypes' norms, and the student-teacher model trains the student alone and hands back a backbone that timm and
vitkit load strictly."""

import dataclasses

import pytest
import timm
import torch
from lightly.loss import DINOLoss as LightlyDINOLoss
from lightly.loss import IBOTPatchLoss as LightlyIBOTPatchLoss
from lightly.loss import KoLeoLoss as LightlyKoLeoLoss
from lightly.loss.swav_loss import sinkhorn as lightly_sinkhorn
from torch.testing import assert_close

import vitkit
from vitkit.models.dino import DINO, DINOConfig, DINOHead, DINOLoss, IBOTPatchLoss, koleo_loss, sinkhorn_knopp

K = 64


def test_dino_loss_and_its_center_equal_lightlys_over_steps():
    g = torch.Generator().manual_seed(0)
    ours, theirs = DINOLoss(K, student_temp=0.1, center_momentum=0.9), LightlyDINOLoss(K, center_momentum=0.9)
    for step, temp in enumerate((0.04, 0.05, 0.07)):
        teacher = [torch.randn(8, K, generator=g) * 3 + step for _ in range(2)]  # a drift for the center to follow
        student = [torch.randn(8, K, generator=g) * 3 for _ in range(6)]  # 2 global, then 4 local views
        assert_close(ours(teacher, student, teacher_temp=temp), theirs(teacher, student, teacher_temp=temp))
        assert_close(ours.center.center, theirs.center.view(1, K))
    assert ours.center.center.abs().sum() > 0


def test_ibot_patch_loss_and_its_center_equal_lightlys_over_steps():
    g = torch.Generator().manual_seed(1)
    ours, theirs = IBOTPatchLoss(K, center_momentum=0.9), LightlyIBOTPatchLoss(K, center_momentum=0.9)
    for temp in (0.04, 0.07):
        mask = torch.rand(4, 5, 5, generator=g) < 0.4
        mask[0] = False  # an image with nothing hidden weighs nothing
        m = int(mask.sum())
        teacher, student = torch.randn(m, K, generator=g) * 3, torch.randn(m, K, generator=g) * 3
        assert_close(ours(teacher, student, mask, teacher_temp=temp), theirs(teacher, student, mask, teacher_temp=temp))
        assert_close(ours.center.center, theirs.center.value)


def test_koleo_equals_lightlys():
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    x[5] = x[3] * 2  # a pair at distance 0 after normalisation: eps keeps the log finite
    assert_close(koleo_loss(x), LightlyKoLeoLoss()(x))


def test_sinkhorn_equals_swavs_routine_and_balances_the_prototypes():
    logits = torch.randn(24, K, generator=torch.Generator().manual_seed(3))
    assert_close(sinkhorn_knopp(logits, 0.05), lightly_sinkhorn(logits, iterations=3, epsilon=0.05))
    crowded = logits.tanh() + torch.linspace(1, 0, K)  # cosines, the first prototypes nearer every row
    assert torch.softmax(crowded / 0.04, 1).sum(0)[: K // 4].sum() > 0.9 * 24  # a softmax gives them nearly all
    q = sinkhorn_knopp(crowded, 0.04, iterations=300)
    assert_close(q.sum(1), torch.ones(24))  # a distribution per row
    assert_close(q.sum(0), torch.full((K,), 24 / K), atol=1e-3, rtol=0)  # every prototype used equally


def test_centering_by_sinkhorn_leaves_no_center():
    loss = DINOLoss(K, centering="sinkhorn")
    out = loss([torch.randn(8, K)] * 2, [torch.randn(8, K)] * 4, teacher_temp=0.07)
    assert out.isfinite() and loss.center.center.abs().sum() == 0
    with pytest.raises(ValueError, match="centering must be 'mean' or 'sinkhorn'"):
        DINOLoss(K, centering="median")


def test_head_gives_unit_prototypes_unless_asked_to_learn_their_norms():
    head = DINOHead(32, out_dim=K, hidden_dim=48, bottleneck_dim=16)
    out = head(torch.randn(5, 32))
    assert out.shape == (5, K) and out.abs().max() <= 1 + 1e-5  # unit bottleneck . unit prototypes
    assert_close(head.last_layer.weight.norm(dim=1), torch.ones(K))
    assert not head.last_layer.parametrizations.weight.original0.requires_grad
    assert DINOHead(32, K, 48, 16, norm_last_layer=False).last_layer.parametrizations.weight.original0.requires_grad


def _tiny(**kw) -> DINO:
    cfg = DINOConfig(encoder="vit_tiny_patch16_224", encoder_overrides=dict(img_size=32, patch_size=8, depth=2,
                                                                          drop_path_rate=0.1),
                     out_dim=K, hidden_dim=48, bottleneck_dim=16, mask_probability=1.0, **kw)
    return DINO(cfg)


def test_the_student_alone_learns_and_the_teacher_follows_as_a_moving_average():
    torch.manual_seed(0)
    model = _tiny()
    glob, local = torch.randn(2, 3, 3, 32, 32), torch.randn(4, 3, 3, 16, 16)
    mask = model.random_masks(2, 3, (4, 4))
    assert mask.shape == (2, 3, 16) and mask.any() and not mask.all()
    out = model(glob, local, mask, teacher_temp=0.04)
    assert all(v.isfinite() and v > 0 for v in (out.loss, out.dino, out.ibot, out.koleo))
    out.loss.backward()
    assert all(p.grad is None for p in model.teacher_parameters())
    assert model.mask_token.grad.abs().sum() > 0 and model.student.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert not model.teacher.training and model.student.training
    before = [p.clone() for p in model.teacher_parameters()]
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(1.0)
    model.update_teacher(0.9)
    student = [p for m in model.student_modules() for p in m.parameters()]
    for b, t, s in zip(before, model.teacher_parameters(), student, strict=True):
        assert_close(t, 0.9 * b + 0.1 * s)


def test_ibot_off_and_koleo_off_are_zero():
    model = _tiny(ibot_weight=0.0, koleo_weight=0.0)
    out = model(torch.randn(2, 2, 3, 32, 32), None, model.random_masks(2, 2, (4, 4)))
    assert out.ibot == 0 and out.koleo == 0 and out.loss == out.dino


def test_a_separate_ibot_head_has_its_own_prototypes():
    model = _tiny(ibot_out_dim=32)
    out = model(torch.randn(2, 2, 3, 32, 32), torch.randn(2, 2, 3, 16, 16), model.random_masks(2, 2, (4, 4)))
    out.loss.backward()
    assert model.student_ibot_head.last_layer.weight.shape == (32, 16) and out.ibot > 0


def test_the_backbone_loads_strictly_in_timm_and_vitkit(tmp_path):
    model = _tiny()
    path = tmp_path / "backbone.pth"
    torch.save(model.backbone().state_dict(), path)
    kw = dict(img_size=32, patch_size=8, depth=2, num_classes=0)
    theirs = timm.create_model("vit_tiny_patch16_224", checkpoint_path=str(path), **kw).eval()
    ours = vitkit.create_model("vit_tiny_patch16_224", checkpoint=path, **kw).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(ours(x), theirs(x), atol=1e-5, rtol=1e-5)
        assert_close(ours(x), model.backbone()(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset, size", [("vit_small_patch14_reg4_dinov2", 28), ("vit_small_patch16_dinov3", 32)])
def test_registers_and_rope_train_and_the_teacher_is_timms_model(preset, size, tmp_path):
    """DINOv2 with registers (iBOT reads the patch tokens after them) and DINOv3 with RoPE (its positions follow
    the global and the local crops' sizes): a step trains every loss, and the teacher, written by save_pretrained,
    is timm's model of the preset with the same outputs."""
    torch.manual_seed(0)
    over = dict(img_size=size, depth=1, embed_dim=64, num_heads=2)
    model = DINO(DINOConfig(encoder=preset, encoder_overrides=over, out_dim=K, hidden_dim=48, bottleneck_dim=16,
                            mask_probability=1.0))
    grid = (size // model.student.patch_size,) * 2
    out = model(torch.randn(2, 2, 3, size, size), torch.randn(2, 2, 3, size // 2, size // 2),
                model.random_masks(2, 2, grid), teacher_temp=0.04)
    assert all(v.isfinite() and v > 0 for v in (out.loss, out.dino, out.ibot, out.koleo))
    out.loss.backward()
    assert model.mask_token.grad.abs().sum() > 0
    model.update_teacher(0.5)
    folder = vitkit.save_pretrained(model.backbone(), tmp_path / "teacher")
    theirs = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        assert_close(theirs(x), model.backbone()(x), atol=1e-5, rtol=1e-5)


def test_what_dino_cannot_train_is_refused():
    with pytest.raises(ValueError, match="DINO trains a ViT with a class token"):
        DINO(DINOConfig(encoder="vit_tiny_patch16_224", encoder_overrides=dict(class_token=False, global_pool="avg")))
    with pytest.raises(ValueError, match="mask_ratio"):
        DINOConfig(mask_ratio=(0.6, 0.2))


def test_packed_crops_give_the_losses_and_gradients_of_the_same_crops_batched():
    """``forward_packed``: the same global and local crops, each packed with its prefix and patches (several to a
    sequence, attention kept inside each), and the same hidden patches, give :meth:`forward`'s DINO, iBOT and KoLeo
    losses and the student's gradients."""
    from vitkit.models.packing import pack

    torch.manual_seed(0)
    batched, packed = _tiny(), _tiny()
    packed.load_state_dict(batched.state_dict())
    batched.eval(), packed.eval()  # no drop path: the two runs draw alike
    glob, local = torch.randn(2, 3, 3, 32, 32), torch.randn(4, 3, 3, 16, 16)
    mask = batched.random_masks(2, 3, (4, 4), generator=torch.Generator().manual_seed(1))
    crops = pack([c for view in glob for c in view], 8, 40, 1)  # crop v·B + b
    # the sequences in reverse: the slots then hold the crops in another order than the crops' own
    crops = dataclasses.replace(crops, patches=crops.patches.flip(0), image=crops.image.flip(0),
                                index=crops.index.flip(0))
    slots = (crops.index >= 1) & (crops.image >= 0)
    hidden = torch.zeros_like(slots)
    hidden[slots] = mask.flatten(0, 1)[crops.image[slots], crops.index[slots] - 1]
    locals_ = pack([c for view in local for c in view], 8, 30, 1)
    want = batched(glob, local, mask, teacher_temp=0.04)
    got = packed.forward_packed(crops, 2, locals_, hidden, teacher_temp=0.04)
    assert crops.patches.shape[0] < 6 and locals_.patches.shape[0] < 12  # several crops to a sequence
    for name in ("loss", "dino", "ibot", "koleo"):
        assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-5)
    want.loss.backward()
    got.loss.backward()
    for (name, a), b in zip(batched.student.named_parameters(), packed.student.parameters(), strict=True):
        assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4, msg=name)
    assert_close(packed.mask_token.grad, batched.mask_token.grad, atol=1e-5, rtol=1e-4)
