"""The one probe solver (``vitkit.evaluation.probe``) is scikit-learn's LogisticRegression at C=1 on standardised
features, for every kind of target the tasks give it: one class of several, one of two (scikit-learn's binary
row), several classes per sample (one regression per class) and class shares (a segmentation patch's pixels,
folded into the segmenter's linear head)."""

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.preprocessing import StandardScaler

from vitkit.evaluation.probe import fit_linear_probe, fit_logistic, fit_multilabel_probe


def _blobs(classes: int, n: int = 400, dim: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, dim, generator=g) * 2
    y = torch.randint(0, classes, (n,), generator=g)
    offset = torch.linspace(-5, 10, dim)  # raw features far from standardised: the folding has work to do
    return (centres[y] + torch.randn(n, dim, generator=g) * 1.5 + offset).double(), y


def _peer(x: torch.Tensor, y: np.ndarray) -> tuple[StandardScaler, LogisticRegression]:
    scaler = StandardScaler().fit(x.numpy())
    return scaler, LogisticRegression(C=1.0, max_iter=5000, tol=1e-10).fit(scaler.transform(x.numpy()), y)


@pytest.mark.parametrize("classes", [2, 3, 5])
def test_one_label_per_sample_gives_scikit_learns_probabilities(classes):
    x, y = _blobs(classes)
    scaler, peer = _peer(x, y.numpy())
    expected = peer.predict_proba(scaler.transform(x.numpy()))
    weight, bias, top1 = fit_linear_probe(x, y, x, y, classes)
    ours = (x.float() @ weight.T + bias).softmax(1).double().numpy()
    np.testing.assert_allclose(ours, expected, atol=1e-4)
    assert top1 == pytest.approx(peer.score(scaler.transform(x.numpy()), y.numpy()), abs=1e-9)
    assert top1 > 1.5 / classes  # the classes are told apart: a regression that moved


def test_a_class_without_training_samples_ranks_last():
    """Below every seen class on every training sample (the head a probe-first run starts from never picks it)."""
    x, y = _blobs(3)
    weight, bias, _ = fit_linear_probe(x, y, x, y, 5)  # classes 3 and 4 never seen
    logits = x.float() @ weight.T + bias
    assert (logits[:, 3:].max(1).values < logits[:, :3].min(1).values).all()


def test_several_labels_per_sample_are_one_regression_per_class():
    x, y = _blobs(4)
    g = torch.Generator().manual_seed(1)
    multi = torch.nn.functional.one_hot(y, 4).double()
    multi[:, 1] = torch.maximum(multi[:, 1], (torch.rand(len(y), generator=g) < 0.3).double())  # co-occurs
    multi[:, 3] = 0  # never present: a constant logit
    weight, bias, _ = fit_multilabel_probe(x, multi, x, multi)
    ours = (x.float() @ weight.T + bias).sigmoid().double()
    scaler = StandardScaler().fit(x.numpy())
    for j in range(3):
        peer = LogisticRegression(C=1.0, max_iter=5000, tol=1e-10).fit(scaler.transform(x.numpy()), multi[:, j])
        np.testing.assert_allclose(ours[:, j].numpy(), peer.predict_proba(scaler.transform(x.numpy()))[:, 1],
                                   atol=1e-4)
    assert (ours[:, 3] < 1e-4).all()


def test_class_shares_fold_into_the_segmenters_linear_head():
    """One class per patch as shares (one-hot) gives scikit-learn's multinomial regression, and the segmenter's
    linear head with the fit in its BatchNorm and 1x1 conv gives its probabilities."""
    from vitkit.models.segmentation import LinearHead
    from vitkit.tasks.segmentation.probe_first import set_linear_head

    x, y = _blobs(3)
    scaler, peer = _peer(x, y.numpy())
    expected = peer.predict_proba(scaler.transform(x.numpy()))
    probe = fit_logistic(x, torch.nn.functional.one_hot(y, 3).float())
    head = LinearHead([6], 3).eval()
    set_linear_head(head, probe.weight, probe.bias, probe.mean, probe.std)
    with torch.no_grad():
        ours = head([x.float().T.reshape(1, 6, 20, 20)]).softmax(1).reshape(3, 400).T.double()
    np.testing.assert_allclose(ours.numpy(), expected, atol=1e-4)
    assert not np.allclose(expected, 1 / 3, atol=0.1)


def test_no_training_sample_is_refused_in_one_line():
    from vitkit.errors import UsageError

    with pytest.raises(UsageError, match="at least one training sample"):
        fit_logistic(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
