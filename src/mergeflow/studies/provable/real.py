"""The seed's Colored-MNIST experiment (its Section 4.1) on the pipeline's real digits: the colouring, the backbone's
last block(s) fine-tuned under one shared probe, alpha-hat, and the addition, negation and out-of-domain
measurements."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, TYPE_CHECKING


from mergeflow.core.errors import MergeflowError
from mergeflow.studies.provable.model import Params, delta, grid, merge
from mergeflow.studies.provable.settings import RELATIONS, ProvableSettings
from mergeflow.studies import no_grad

if TYPE_CHECKING:
    import torch


# The seed's Section 4.1 on the pipeline's real handwritten digits: a task is parity (odd: class 1, the seed's +1;
# even: class 0, its -1) on digits inked red or green, r_o of the odd digits red and r_e = 1 - r_o of the even ones.
def parity(labels: torch.Tensor) -> torch.Tensor:
    """1 for odd digits, 0 for even ones."""
    return (labels % 2).long()


def red_mask(labels: torch.Tensor, r_o: float, gen: torch.Generator) -> torch.Tensor:
    """Which images are inked red: exactly round(r_o n_odd) of the odd digits and round((1 - r_o) n_even) of the even
    ones (r_e = 1 - r_o), each set drawn uniformly; the others are green."""
    import torch

    odd = parity(labels) == 1
    mask = torch.zeros(len(labels), dtype=torch.bool)
    for members, r in ((odd, r_o), (~odd, 1.0 - r_o)):
        idx = torch.nonzero(members).flatten()
        mask[idx[torch.randperm(len(idx), generator=gen)[: round(r * len(idx))]]] = True
    return mask


def colour(images: torch.Tensor, red: torch.Tensor) -> torch.Tensor:
    """Grey-on-black uint8 images [N, H, W, 3] -> the same ink (the channels' mean) in the red channel where ``red``,
    in the green channel elsewhere, the other channels black (Colored-MNIST)."""
    import torch

    ink = images.float().mean(-1).round().to(torch.uint8)
    out = torch.zeros_like(images)
    r = red[:, None, None]
    out[..., 0] = torch.where(r, ink, torch.zeros_like(ink))
    out[..., 1] = torch.where(r, torch.zeros_like(ink), ink)
    return out


def alpha_hat(out1_d1: torch.Tensor, out2_d1: torch.Tensor, out1_d2: torch.Tensor, out2_d2: torch.Tensor) -> float:
    """The seed's (11): the mean over D_j of the cosine between the two fine-tuned models' centred outputs (each
    model's outputs minus their mean over D_j), averaged over D_1 and D_2. Outputs [N, K]."""

    import torch

    def one(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = (a - a.mean(0)).double(), (b - b.mean(0)).double()
        return float(torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12).mean())

    return (one(out1_d1, out2_d1) + one(out1_d2, out2_d2)) / 2


def _tail_class() -> type:
    """Tail, defined on first use: it subclasses torch.nn.Module, and this module loads without torch."""
    import torch

    class Tail(torch.nn.Module):
        """The fine-tuned part of the backbone: its last ``blocks`` blocks, final norm, pooling and fc norm, from the
        tokens the frozen blocks before them give to the pooled features (a timm VisionTransformer)."""

        def __init__(self, net: torch.nn.Module, blocks: int):
            super().__init__()
            self.blocks = torch.nn.Sequential(*[copy.deepcopy(b) for b in list(net.blocks)[len(net.blocks) - blocks :]])
            self.norm = copy.deepcopy(net.norm)
            self.fc_norm = copy.deepcopy(net.fc_norm)
            self._pool = [
                net.pool
            ]  # parameter-free (global average over the patch tokens here); a list: not a submodule

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.fc_norm(self._pool[0](self.norm(self.blocks(tokens))))

    return Tail


def split_backbone(backbone: Any, blocks: int) -> tuple[Any, torch.nn.Module]:
    """(prefix: uint8 images -> tokens, with the backbone's normalisation; Tail) with tail(prefix(x)) == backbone(x)."""
    import torch

    net = backbone.net
    for name in ("blocks", "patch_embed", "_pos_embed", "norm", "fc_norm", "pool"):
        if not hasattr(net, name):
            raise MergeflowError(
                "study provable: the real-data part splits a timm "
                f"VisionTransformer; backbone '{type(net).__name__}' has no '{name}'"
            )
    frozen = list(net.blocks)[: max(0, len(net.blocks) - blocks)]

    @torch.no_grad()
    def prefix(images: torch.Tensor) -> torch.Tensor:
        x = net.norm_pre(net.patch_drop(net._pos_embed(net.patch_embed(backbone.normalise(images)))))
        for b in frozen:
            x = b(x)
        return x

    return prefix, _tail_class()(net, min(blocks, len(net.blocks)))


def _tokens(prefix, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    import torch

    return torch.cat([prefix(images[i : i + batch]) for i in range(0, len(images), batch)])


@no_grad
def tail_outputs(tail: torch.nn.Module, state: Params, head: torch.nn.Linear, tokens: torch.Tensor) -> torch.Tensor:
    """The head's logits [N, 2] of the tail holding ``state`` (a full state dict of the tail)."""
    import torch

    return head(torch.func.functional_call(tail, state, (tokens,)))


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return float((logits.argmax(1) == y).float().mean())


@dataclass
class RealTask:
    """One coloured parity task: its r_o, its test (and validation) tokens and labels, its fine-tuned task vector."""

    r_o: float
    test: tuple[torch.Tensor, torch.Tensor]
    val: tuple[torch.Tensor, torch.Tensor]
    red_share: dict[str, float]  # measured red proportion among odd / even training digits
    delta: Params
    accuracy: float  # the fine-tuned model's test accuracy (Psi*_T on T)
    pretrained_accuracy: float  # Psi0 (with the shared head) on T


@dataclass
class RealPair:
    relation: str
    r_o: float  # T2's
    alpha_hat: float
    acc1: list[float]  # per lambda: test accuracy on T1 of Psi0 + dPsi1 + lambda dPsi2
    acc2: list[float]  # on T2
    finetuned1: float
    finetuned2: float


@dataclass
class RealOod:
    r_o: tuple[float, float, float]  # T1, T2, T'
    alpha12: float
    gammas: tuple[float, float]  # alpha-hat of (T1, T') and (T2, T')
    finetuned: float  # Psi*_T' on T' (test)
    lambdas: list[float]
    acc: list[list[float]]  # test accuracy on T', [i][j]: lambda1 = lambdas[i], lambda2 = lambdas[j]
    val_acc: list[list[float]]  # the same on T''s validation split (where (lambda1, lambda2) is chosen)

    def at(self, l1: float, l2: float, grid: str = "acc") -> float | None:
        try:
            i, j = self.lambdas.index(round(l1, 6)), self.lambdas.index(round(l2, 6))
        except ValueError:
            return None
        return getattr(self, grid)[i][j]

    def chosen(self) -> tuple[float, float]:
        """The (lambda1, lambda2) of the best validation accuracy (the first on ties, lambda1 then lambda2
        ascending)."""
        best = max(((v, -i, -j) for i, row in enumerate(self.val_acc) for j, v in enumerate(row)))
        return self.lambdas[-best[1]], self.lambdas[-best[2]]

    def test_best(self) -> tuple[float, float, float]:
        """(lambda1, lambda2, accuracy) of the best test accuracy: the seed's choice (it searched on the test set)."""
        best = max(((v, -i, -j) for i, row in enumerate(self.acc) for j, v in enumerate(row)))
        return self.lambdas[-best[1]], self.lambdas[-best[2]], best[0]


@dataclass
class RealMeasurements:
    task: str
    blocks: int  # blocks fine-tuned
    depth: int  # the backbone's blocks
    steps: int
    images: dict[str, int]  # per split
    probe: dict[str, float]  # the shared head: C and its validation accuracy (balanced colours)
    lambdas: list[float]
    tasks: dict[float, RealTask]  # by r_o
    pairs: list[RealPair]
    ood: RealOod | None
    seconds: float


def real_skip_reason(params: Any, layout: Any, s: ProvableSettings) -> str | None:
    """Why the real-data part cannot run here (None: it can)."""
    if not s.real:
        return "real: false in studies.provable"
    if layout is None or not hasattr(params, "suite"):
        return "no pipeline outputs given (the study ran without a layout)"
    if s.real_task not in params.suite.tasks:
        return (
            f"task '{s.real_task}' is not in suite.tasks "
            f"({', '.join(params.suite.tasks)}): the seed's Colored-MNIST needs real digits"
        )
    return None


def measure_real(params: Any, layout: Any, s: ProvableSettings) -> RealMeasurements:
    """Every real-data measurement, on one CPU thread (as ``measure``: reproducible whatever the machine), restored
    after."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure_real(params, layout, s)
    finally:
        torch.set_num_threads(threads)


def _real_inputs(params: Any, layout: Any, s: ProvableSettings) -> tuple[Any, Any, dict, int]:
    """The task's data, the backbone's trained tail (its first ``real_blocks`` blocks frozen in front of it), the
    frozen part's tokens of every image inked red and inked green (computed once), and the backbone's depth."""
    import torch

    from mergeflow.ml.data import load_task
    from mergeflow.ml.models import load_backbone

    data = load_task(layout.task_data(s.real_task), params.suite.image_size)
    backbone = load_backbone(params.backbone, layout.pretrained).eval()
    prefix, tail0 = split_backbone(backbone, s.real_blocks)
    tail0.eval()
    tokens = {}
    for split in ("train", "val", "test"):
        images = data.split(split).inputs
        tokens[split] = {
            c: _tokens(prefix, colour(images, torch.full((len(images),), c == "red"))) for c in ("red", "green")
        }
    check = data.test.inputs[:8]
    if not torch.allclose(
        tail0(prefix(colour(check, torch.ones(8, dtype=torch.bool)))),
        backbone(colour(check, torch.ones(8, dtype=torch.bool))),
        atol=1e-5,
    ):
        raise MergeflowError(
            "study provable: the split backbone (frozen prefix + tail) does not reproduce the backbone"
        )
    return data, tail0, tokens, len(backbone.net.blocks)


def _real_ood(s: ProvableSettings, tasks: list[RealTask], alpha_between, tail0, theta0, head) -> RealOod:
    """Out of domain: theta0 + l1 delta_a + l2 delta_b on a third task's test and validation splits, over a grid of
    (l1, l2), with the alphas between the three tasks."""
    import torch

    a, b, target = tasks
    lams = grid(s.real_ood_lambda_min, s.real_ood_lambda_max, s.real_ood_lambda_step)
    x, y, n = (
        torch.cat([target.test[0], target.val[0]]),
        torch.cat([target.test[1], target.val[1]]),
        len(target.test[1]),
    )
    acc, val_acc = [], []
    for l1 in lams:
        rows = [tail_outputs(tail0, merge(theta0, [a.delta, b.delta], [l1, l2]), head, x).argmax(1) == y for l2 in lams]
        acc.append([float(r[:n].float().mean()) for r in rows])
        val_acc.append([float(r[n:].float().mean()) for r in rows])
    return RealOod(
        tuple(s.real_ood_r),
        alpha_between(a, b),
        (alpha_between(a, target), alpha_between(b, target)),
        target.accuracy,
        lams,
        acc,
        val_acc,
    )


@dataclass
class _Colouring:
    """Colours a split's digits for a task: which are red (drawn with a seed from ``seed``, r_o and ``salt``), and
    the frozen part's tokens of each image in its colour."""

    seed: int
    data: Any
    tokens: dict[str, dict[str, torch.Tensor]]  # split -> colour -> tokens of every image
    labels: dict[str, torch.Tensor]  # split -> parity

    def __call__(self, split: str, r_o: float, salt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, parity labels, red mask) of ``split`` coloured with r_o."""
        import torch

        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + round(r_o * 1000) * 10 + salt)
        red = red_mask(self.data.split(split).labels, r_o, gen)
        return (
            torch.where(red[:, None, None], self.tokens[split]["red"], self.tokens[split]["green"]),
            self.labels[split],
            red,
        )


def _shared_head(coloured: _Colouring, tail0: torch.nn.Module, s: ProvableSettings, seed: int) -> Any:
    """The shared, frozen binary head: the pipeline's probe on Psi0's features of digits coloured independently of
    parity."""
    import torch

    from mergeflow.config import ProbeConfig
    from mergeflow.ml.probes import fit_probe

    with torch.no_grad():
        tr, ytr, _ = coloured("train", 0.5, 7)
        va, yva, _ = coloured("val", 0.5, 8)
        return fit_probe(
            tail0(tr),
            ytr,
            tail0(va),
            yva,
            ProbeConfig(c_grid=s.real_probe_c, max_iter=s.real_probe_max_iter),
            seed=seed,
            num_classes=2,
        )


@dataclass
class _RealTasks:
    """The coloured parity tasks by r_o, each fine-tuned (from theta0, under the shared head) on first use."""

    coloured: _Colouring
    tail0: Any
    theta0: Params
    head: Any
    cfg: Any  # the pipeline's finetune settings
    seed: int
    tasks: dict[float, RealTask] = field(default_factory=dict)

    def task(self, r_o: float) -> RealTask:
        import torch

        from mergeflow.ml.training import train_loop

        if r_o in self.tasks:
            return self.tasks[r_o]
        x, y, red = self.coloured("train", r_o, 0)
        odd = y == 1
        share = {"odd": float(red[odd].float().mean()), "even": float(red[~odd].float().mean())}
        model = copy.deepcopy(self.tail0).train()
        head, cfg = self.head, self.cfg

        def loss_fn(idx: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(head(model(x[idx])), y[idx])

        train_loop(
            model,
            loss_fn,
            len(x),
            cfg,
            optimizer=cfg.optimizer,
            momentum=cfg.momentum,
            seed=self.seed * 1_000_003 + round(r_o * 1000),
            device=torch.device("cpu"),
            desc=f"provable: finetune r_o={r_o:g}",
        )
        model.eval()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        test, val = self.coloured("test", r_o, 1)[:2], self.coloured("val", r_o, 2)[:2]
        self.tasks[r_o] = RealTask(
            r_o,
            test,
            val,
            share,
            delta(state, self.theta0),
            _accuracy(tail_outputs(self.tail0, state, head, test[0]), test[1]),
            _accuracy(tail_outputs(self.tail0, self.theta0, head, test[0]), test[1]),
        )
        return self.tasks[r_o]

    def finetuned(self, t: RealTask) -> Params:
        return merge(self.theta0, [t.delta], [1.0])

    def alpha_between(self, a: RealTask, b: RealTask) -> float:
        fa, fb = self.finetuned(a), self.finetuned(b)
        return alpha_hat(
            tail_outputs(self.tail0, fa, self.head, a.test[0]),
            tail_outputs(self.tail0, fb, self.head, a.test[0]),
            tail_outputs(self.tail0, fa, self.head, b.test[0]),
            tail_outputs(self.tail0, fb, self.head, b.test[0]),
        )


def _real_pair(run: _RealTasks, t1: RealTask, relation: str, r_o: float, lambdas: list[float]) -> RealPair:
    """T1 and the T2 of ``relation`` (fine-tuned here if new): theta0 + delta1 + lambda delta2 on both test sets,
    per lambda, and alpha-hat."""
    import torch

    t2 = run.task(r_o)
    x, y, n1 = torch.cat([t1.test[0], t2.test[0]]), torch.cat([t1.test[1], t2.test[1]]), len(t1.test[1])
    acc1, acc2 = [], []
    for lam in lambdas:
        pred = (
            tail_outputs(run.tail0, merge(run.theta0, [t1.delta, t2.delta], [1.0, lam]), run.head, x).argmax(1) == y
        )  # both test sets in one pass
        acc1.append(float(pred[:n1].float().mean()))
        acc2.append(float(pred[n1:].float().mean()))
    return RealPair(relation, t2.r_o, run.alpha_between(t1, t2), acc1, acc2, t1.accuracy, t2.accuracy)


def _measure_real(params: Any, layout: Any, s: ProvableSettings) -> RealMeasurements:
    from mergeflow.ml.training import total_steps

    start = time.perf_counter()
    seed = int(params.seed)
    data, tail0, tokens, depth = _real_inputs(params, layout, s)
    theta0 = {k: v.detach().clone() for k, v in tail0.state_dict().items()}
    labels = {split: parity(data.split(split).labels) for split in ("train", "val", "test")}
    coloured = _Colouring(seed, data, tokens, labels)
    probe = _shared_head(coloured, tail0, s, seed)
    run = _RealTasks(coloured, tail0, theta0, probe.head.requires_grad_(False), params.finetune, seed)

    lambdas = grid(s.real_lambda_min, s.real_lambda_max, s.real_lambda_step)
    t1 = run.task(s.real_r_t1)
    pairs = [_real_pair(run, t1, relation, s.real_r_t2[relation], lambdas) for relation in RELATIONS]
    ood = (
        None
        if s.real_ood_r is None
        else _real_ood(s, [run.task(r) for r in s.real_ood_r], run.alpha_between, tail0, theta0, run.head)
    )

    images = {split: len(data.split(split).labels) for split in ("train", "val", "test")}
    return RealMeasurements(
        s.real_task,
        min(s.real_blocks, depth),
        depth,
        total_steps(params.finetune, images["train"]),
        images,
        {"C": probe.c, "val_accuracy": probe.val_accuracy},
        lambdas,
        run.tasks,
        pairs,
        ood,
        time.perf_counter() - start,
    )
