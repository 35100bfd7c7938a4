"""Each merging method against values computed by hand on tiny tensors, the papers' identities, and the
properties every registered method must keep."""

import pytest
import torch

from mergeflow.params import parse_params
from mergeflow.core.errors import MergeflowError
from mergeflow.ml.merging import REGISTRY, validate_overrides

T = torch.tensor


def close(a, b):
    return torch.allclose(a, b, atol=1e-6)


# ------------------------------------------------------------------ hand-computed values
def test_task_arithmetic_by_hand():
    theta0 = {"w": T([1.0, 2.0])}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([0.0, 2.0])}}
    assert close(REGISTRY["task_arithmetic"](theta0, tvs, lam=0.3)["w"], T([1.3, 2.6]))


def test_weight_averaging_by_hand():
    theta0 = {"w": T([1.0, 2.0])}
    tvs = {"a": {"w": T([1.0, 0.0])}, "b": {"w": T([0.0, 2.0])}}
    assert close(REGISTRY["weight_averaging"](theta0, tvs)["w"], T([1.5, 3.0]))


def test_ties_per_tensor_by_hand():
    # k = 0.4 keeps floor(0.4 x 5) = 2 largest of 5 entries per task (rounding 'floor'):
    #   trimmed a = [3, 0, 0, -4, 0], trimmed b = [-2, 2, 0, 0, 0]; total mass [1, 2, 0, -4, 0] elects [+, +, 0, -, 0];
    #   disjoint mean of agreeing entries = [3, 2, 0, -4, 0]
    theta0 = {"w": T([10.0, 10.0, 10.0, 10.0, 10.0])}
    tvs = {"a": {"w": T([3.0, -1.0, 0.5, -4.0, 2.0])}, "b": {"w": T([-2.0, 2.0, 1.0, -1.0, 0.2])}}
    merged = REGISTRY["ties"](theta0, tvs, k=0.4, trim_scope="tensor", rounding="floor", lam=1.0)
    assert close(merged["w"], T([13.0, 12.0, 10.0, 6.0, 10.0]))
    merged = REGISTRY["ties"](theta0, tvs, k=0.4, trim_scope="tensor", rounding="floor", lam=0.5)
    assert close(merged["w"], T([11.5, 11.0, 10.0, 8.0, 10.0]))


def test_ties_disjoint_mean_averages_only_agreeing_entries():
    # entry 0: +3 and +1 agree with the elected + sign -> mean 2; entry 1: -5 outweighs +1 -> -5
    theta0 = {"w": torch.zeros(2)}
    tvs = {"a": {"w": T([3.0, -5.0])}, "b": {"w": T([1.0, 1.0])}}
    assert close(REGISTRY["ties"](theta0, tvs, k=1.0, trim_scope="tensor", lam=1.0)["w"], T([2.0, -5.0]))


def test_ties_global_trim_differs_from_per_tensor():
    # one task, k = 0.5 of 4 entries (floor: 2): globally the two
    # largest are both in 'a'; per tensor each keeps its largest
    theta0 = {"a": torch.zeros(2), "b": torch.zeros(2)}
    tvs = {"t": {"a": T([10.0, 9.0]), "b": T([1.0, 2.0])}}
    glob = REGISTRY["ties"](theta0, tvs, k=0.5, trim_scope="global", rounding="floor", lam=1.0)
    per = REGISTRY["ties"](theta0, tvs, k=0.5, trim_scope="tensor", rounding="floor", lam=1.0)
    assert close(glob["a"], T([10.0, 9.0])) and close(glob["b"], T([0.0, 0.0]))
    assert close(per["a"], T([10.0, 0.0])) and close(per["b"], T([0.0, 2.0]))


# ------------------------------------------------------------------ identities from the papers
def _random_models(T_=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    theta0 = {
        "blocks.0.attn.qkv.weight": torch.randn(12, 4, generator=g),
        "blocks.0.norm1.bias": torch.randn(4, generator=g),
        "pos_embed": torch.randn(1, 3, 4, generator=g),
    }
    tvs = {f"t{i}": {k: 0.1 * torch.randn(v.shape, generator=g) for k, v in theta0.items()} for i in range(T_)}
    return theta0, tvs


def test_task_arithmetic_at_one_over_T_is_weight_averaging():
    theta0, tvs = _random_models()
    ta = REGISTRY["task_arithmetic"](theta0, tvs, lam=1 / len(tvs))
    wa = REGISTRY["weight_averaging"](theta0, tvs)
    assert all(close(ta[k], wa[k]) for k in theta0)


def test_ties_full_density_without_sign_conflict_is_mean_of_task_vectors():
    theta0, tvs = _random_models()
    tvs = {t: {k: v.abs() for k, v in tv.items()} for t, tv in tvs.items()}  # all positive: no conflict
    ties = REGISTRY["ties"](theta0, tvs, k=1.0, trim_scope="global", lam=1.0)
    mean = {k: theta0[k] + torch.stack([tv[k] for tv in tvs.values()]).mean(0) for k in theta0}
    assert all(close(ties[k], mean[k]) for k in theta0)


# ------------------------------------------------------------------ every registered method
# hyperparameters under which merging T copies of one model must give that model back; None: the method changes
# the spectrum or the rank on purpose (TSV, Iso) or is not a merge (negation), so the identity does not hold
IDENTITY_SETTINGS = {
    "weight_averaging": {},
    "task_arithmetic": {"lam": 0.25},
    "ties": {"k": 1.0, "lam": 1.0},
    "dare_linear": {"p": 0.0, "lam": 0.25},
    "dare_ties": {"p": 0.0, "lam": 1.0},
    "breadcrumbs": {"gamma": 0.0, "beta": 1.0, "alpha": 0.25},
    "magmax": {"lam": 1.0},
    "consensus_ta": {"tall_lambda": 0.2, "alpha": 0.25},
    "consensus_ties": {"tall_lambda": 0.2, "ties_k": 1.0, "alpha": 1.0},
    "low_rank_ta": {"rank_ratio": 1.0, "lam": 0.25},
    "cart": {},
    "slerp": {},
    "tall_ties": {"ties_k": 1.0, "lam": 1.0},
    "emr": {},
    "cart_indexing": {},
    "tsv_m": None,
    "iso_c": None,
    "iso_cts": None,
    "tsv_c": None,
    "task_negation": None,
    "fisher": {},
    "regmean": {},
    "adamerging": {"lr": 0.0, "init": 0.25},  # lam = 1/T
    "adamerging_task": {"lr": 0.0, "init": 0.25},
    "adamerging_cart": {},  # copies: the centred vectors are zero, theta_avg is the model
    "model_stock": {},  # copies: cos = 1, so t = 1 and the average
    "karcher": {},  # copies: one direction, its norm
    "multislerp": {},
    "della": {"p": 0.0, "epsilon": 0.0, "lam": 1.0},  # no drop: TIES' disjoint mean of copies
    "della_linear": {"p": 0.0, "epsilon": 0.0, "lam": 0.25},
    "breadcrumbs_ties": {"gamma": 0.0, "beta": 1.0, "fuse": "mean", "lam": 1.0},
    "sce": {"lam": 1.0},  # equal energies: TIES' disjoint mean
    "nuslerp": {},
    "nearswap": {"t": 10.0},  # every entry nearer than t: weights 1
    "lines": {"beta": 0.0},  # alpha = 1/T scales the summed copies back to one
    "wudi": {"solver": "exact"},
    "knots": {"k": 1.0, "lam": 1.0},  # copies share one basis and one set of coefficients: their disjoint mean
    "adarank": {},  # copies: the centred directions are zero, theta_avg is the model
    "fw_merging": {
        "init": "base",
        "steps": 1,
        "step_size": 1.0,
        "scaling": 1.0,
        "examples": 8,
    },  # gamma = 1 onto a copy
    "svc": {"base": "weight_averaging"},  # copies: s = 1 everywhere, gamma = 1, their average
    "surgery": None,
    # not a state dict of the backbone: tests/test_wemoe.py (constant routing is task arithmetic)
    # its base runs at its own defaults (AdaMerging's lambda 0.3, not 1/T)
    "wemoe": None,
    "regmean_plusplus": {},  # copies: every task's weights are the model's, and so is their regression mean
    "pcb": None,  # its min-max weights drop each task's weakest entry even at ratio 1 (the authors' scaling)
    # each task's layer scaled to norm lam, and theta0 outside the matrices
    # tau is its own least-interference point (Adam's 300 small steps stop short of it)
    "doge_ta": None,
    # routed networks, not state dicts: tests/test_smile.py (one task at full rank is its model),
    # tests/test_ensemble.py (an ensemble of copies is the model)
    "arcee_fusion": None,  # keeps only each task's important entries (outliers of |tau| * KL) on purpose
    "ram": {"epsilon": 0.0, "lam": 1.0},  # copies: every entry shared, their mean
    "ram_plus": {"epsilon": 0.0, "lam": 1.0},  # copies: no unique entry, so no rescale: their mean
    "expo": {"alpha": 0.0},  # alpha 0: weight averaging
    "tatr": {"quantile": 1.0, "cut": "inclusive", "lam": 0.25},  # an empty mask: task arithmetic
    "randes": None,  # the other tasks' sign-flipped vectors are added on purpose
    "gossip": {"weight": 1 / 3},  # a ring of four: each node sums three copies
    "gossip_adamerging": {"lr": 0.0, "init": 1 / 3},  # lr 0: gossip at init over three distinct neighbours
    "ada_svd": {"others": "average"},  # copies: routing 1/T on one dW; the norms their mean
    "smile": None,
    "simple_ensemble": None,
    "weighted_ensemble": None,
    "max_model_predictor": None,
}
PAIRS_ONLY = {"slerp", "nuslerp"}


class _BiasNorm(torch.nn.Module):
    """A layer norm whose only parameter is its bias (_random_models has no norm weight)."""

    def __init__(self, width):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, x.shape[-1:]) + self.bias


class _ToyBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.qkv = torch.nn.Linear(4, 12, bias=False)
        self.norm1 = _BiasNorm(4)

    def forward(self, x):
        return self.attn.qkv(self.norm1(x))


class _ToyNet(torch.nn.Module):
    """A network whose parameters carry _random_models' names: the data-aware methods' forward on it, shaped as a
    timm ViT (patch_embed, _pos_embed, patch_drop, norm_pre, blocks) for RegMean++'s block-by-block pass."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_ToyBlock()])
        self.pos_embed = torch.nn.Parameter(torch.zeros(1, 3, 4))
        self.patch_embed = self.patch_drop = self.norm_pre = torch.nn.Identity()

    def _pos_embed(self, x):
        return x + self.pos_embed

    def forward(self, x):
        return self.blocks[0](self._pos_embed(x)).mean(1)


class _ToyBackbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = _ToyNet()

    def normalise(self, x):
        return x

    def embed(self, features):  # mergeflow.ml.models.Backbone's interface: pooled features as they are
        return features


def _toy_data(tasks):
    """Statistics and an entropy objective for _random_models' keys: Fishers and Grams from a fixed generator."""
    from mergeflow.ml.merging import MergeData
    from mergeflow.ml.merging._adaptive import EntropyObjective

    g = torch.Generator().manual_seed(7)
    theta0, _ = _random_models()
    stats = {}
    for t in tasks:
        fisher = {k: torch.rand(v.shape, generator=g) for k, v in theta0.items()}
        x = torch.randn(20, 4, generator=g)
        stats[t] = {"fisher_sampled": fisher, "fisher_empirical": fisher, "gram": {"blocks.0.attn.qkv.weight": x.T @ x}}
    torch.manual_seed(0)
    heads = {t: torch.nn.Linear(12, 3) for t in tasks}
    inputs = {t: torch.randn(32, 3, 4, generator=g) for t in tasks}
    objective = EntropyObjective(
        _ToyBackbone(), heads, {"test": inputs, "val": inputs, "train": inputs}, torch.device("cpu")
    )
    labels = {t: torch.randint(0, 3, (32,), generator=g) for t in tasks}
    return MergeData(
        statistics=stats, objective=objective, backbone=_ToyBackbone(), train_inputs=inputs, train_labels=labels
    )


def models_of(name, theta0, tvs, **hp):
    """{task: that task's merged model} for any kind of method."""
    method = REGISTRY[name]
    if method.reads:
        method = method.with_data(_toy_data(list(tvs)))
        hp = {"steps": 5} | hp if "steps" in method.defaults else hp
        hp = {"rounds": 2} | hp if "rounds" in method.defaults else hp  # gossip AdaMerging: steps at every round
    if method.kind == "negation":
        return {t: method(theta0, {t: tv}, **hp) for t, tv in tvs.items()}
    out = method(theta0, tvs, **hp)
    if method.kind == "per_task":
        return {t: method.reconstruct(out, theta0, t) for t in tvs}
    return {t: out for t in tvs}


def _inputs(name, n=4):
    theta0, tvs = _random_models(T_=2 if name in PAIRS_ONLY else n)
    return theta0, tvs


# a routed method (WEMoE) gives a network, not the backbone's state dict: tests/test_wemoe.py checks it
@pytest.mark.parametrize("name", sorted(n for n, m in REGISTRY.items() if m.kind != "routed"))
def test_every_method_keeps_keys_shapes_dtypes_and_is_finite_and_deterministic(name):
    theta0, tvs = _inputs(name)
    first, second = models_of(name, theta0, tvs), models_of(name, theta0, tvs)
    for t in tvs:
        assert list(first[t]) == list(theta0)
        for k in theta0:
            assert first[t][k].shape == theta0[k].shape and first[t][k].dtype == theta0[k].dtype
            assert torch.isfinite(first[t][k]).all()
            assert torch.equal(first[t][k], second[t][k])


def test_identity_settings_cover_every_method():
    assert set(IDENTITY_SETTINGS) == set(REGISTRY)


@pytest.mark.parametrize("name", sorted(n for n, hp in IDENTITY_SETTINGS.items() if hp is not None))
def test_every_method_merging_copies_of_one_model_returns_it(name):
    theta0, tvs = _inputs(name)
    same = {f"copy{i}": tvs[next(iter(tvs))] for i in range(len(tvs))}
    for model in models_of(name, theta0, same, **IDENTITY_SETTINGS[name]).values():
        assert all(close(model[k], theta0[k] + same["copy0"][k]) for k in theta0), name


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_method_declares_a_paper_and_a_valid_grid(name):
    method = REGISTRY[name]
    assert (
        method.paper
        and method.fn.__module__.startswith("mergeflow.ml.merging.")
        and method.fn.__module__ != "mergeflow.ml.merging"
    )
    assert (method.fn.__doc__ or __import__(method.fn.__module__, fromlist=["x"]).__doc__).strip()
    assert set(method.grid) <= set(method.defaults)
    validate_overrides(method, {k: list(v) for k, v in method.grid.items()}, where=f"merge.{name}")


def test_overrides_turn_scalars_into_fixed_values_and_lists_into_grids():
    ties = REGISTRY["ties"]
    fixed, grid = ties.search_space({"k": [0.1, 0.2], "lam": 1.0})
    assert grid == {"k": [0.1, 0.2]} and fixed["lam"] == 1.0 and "k" not in fixed
    assert [c["k"] for c in ties.candidates({"k": [0.1, 0.2], "lam": 1.0})] == [0.1, 0.2]


def _params(merge: dict) -> dict:
    return {"suite": {"tasks": ["digits"]}, "merge": merge}


def test_unknown_hyperparameter_is_one_line_naming_the_key():
    with pytest.raises(
        MergeflowError, match=r"merge\.ties\.kk: unknown hyperparameter \(allowed: k, trim_scope, rounding, lam\)"
    ):
        parse_params(_params({"methods": ["ties"], "ties": {"kk": 0.1}}))


def test_wrong_hyperparameter_type_names_the_key():
    with pytest.raises(MergeflowError, match=r"merge\.task_arithmetic\.lam: expected float"):
        parse_params(_params({"methods": ["task_arithmetic"], "task_arithmetic": {"lam": ["big"]}}))


def test_unknown_method_names_the_closest_registered_ones():
    with pytest.raises(
        MergeflowError,
        match=r"^params.yaml: merge.methods: unknown merge method 'soup' \(`mergeflow methods` lists all \d+\)$",
    ):
        parse_params(_params({"methods": ["soup"]}))
    with pytest.raises(
        MergeflowError,
        match=r"^params.yaml: merge.tie: unknown merge method 'tie' \(did you mean ties\? `mergeflow methods`",
    ):
        parse_params(_params({"methods": ["ties"], "tie": {"k": 0.1}}))


@pytest.mark.parametrize("name", sorted(n for n, m in REGISTRY.items() if m.coefficient))
def test_declared_coefficient_is_affine(name):
    """The search interpolates along a method's coefficient; that is exact only if the merge is affine in it."""
    theta0, tvs = _random_models()
    method, coef = REGISTRY[name], REGISTRY[name].coefficient
    base, unit, at = (method(theta0, tvs, **{coef: c}) for c in (0.0, 1.0, 0.7))
    assert all(torch.allclose(at[k], base[k] + 0.7 * (unit[k] - base[k]), atol=1e-5) for k in theta0)


def test_search_by_interpolation_matches_direct_merges():
    from mergeflow.ml.merging.search import merged_candidates

    theta0, tvs = _random_models()
    fixed, grid = REGISTRY["ties"].search_space({"lam": [0.5, 1.5], "trim_scope": "tensor"})
    for hp, merged in merged_candidates(REGISTRY["ties"], fixed, grid, theta0, tvs):
        direct = REGISTRY["ties"](theta0, tvs, **hp)
        assert all(torch.allclose(merged[k], direct[k], atol=1e-5) for k in theta0)


def test_lazy_state_dicts_merge_like_in_memory_ones(tmp_path):
    from mergeflow.core.io import LazyStateDict, save_state_dict

    theta0, tvs = _random_models()
    save_state_dict(tmp_path / "theta0.safetensors", theta0)
    for t, tv in tvs.items():
        save_state_dict(tmp_path / f"{t}.safetensors", tv)
    lazy = {t: LazyStateDict(tmp_path / f"{t}.safetensors") for t in tvs}
    for name in REGISTRY:
        if name in PAIRS_ONLY or REGISTRY[name].kind == "routed":  # routed: the tiny pipeline's stage reads lazily
            continue
        a = models_of(name, LazyStateDict(tmp_path / "theta0.safetensors"), lazy)
        b = models_of(name, theta0, tvs)
        assert all(torch.equal(a[t][k], b[t][k]) for t in tvs for k in theta0), name


class FakeEvaluator:
    """Accuracy of a model on task t = -|mean of its weights - target_t|: the search must find the argmax."""

    def __init__(self, targets):
        self.targets = targets

    def _score(self, task, state):
        return -abs(float(torch.cat([v.flatten() for v in state.values()]).mean()) - self.targets[task])

    def task(self, task, state):
        return self._score(task, state)

    def __call__(self, state):
        return {t: self._score(t, state) for t in self.targets}

    def per_task(self, model_of, feature_maps=None):
        return {t: self._score(t, model_of(t)) for t in self.targets}


def test_search_picks_the_best_validation_point_and_per_task_choices():
    from mergeflow.ml.merging.search import search

    theta0 = {"w": torch.zeros(4)}
    tvs = {"a": {"w": torch.ones(4)}, "b": {"w": torch.ones(4)}}
    best, merged, curve, _ = search(
        REGISTRY["task_arithmetic"], {"lam": [0.1, 0.25, 0.5]}, theta0, tvs, FakeEvaluator({"a": 0.5, "b": 0.5})
    )
    assert best["hyperparameters"]["lam"] == 0.25 and torch.allclose(merged["w"], torch.full((4,), 0.5))
    assert [r["hyperparameters"]["lam"] for r in curve] == [0.1, 0.25, 0.5]

    # consensus: lambda_t is chosen per task, alpha then on the average
    tvs = {"a": {"w": torch.tensor([1.0, 0.0, 0.0, 0.0])}, "b": {"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}}
    best, _, curve, per_task = search(
        REGISTRY["consensus_ta"],
        {"tall_lambda": [0.2, 2.0], "alpha": [0.5, 1.0]},
        theta0,
        tvs,
        FakeEvaluator({"a": 0.0, "b": 1.0}),
    )
    assert set(per_task["chosen"]["tall_lambda"]) == {"a", "b"} and len(curve) == 2
    assert "tall_lambda" not in best["hyperparameters"]


@pytest.mark.parametrize("name", ["consensus_ta", "consensus_ties", "tall_ties"])
def test_per_task_choice_merges_the_shared_vector_once(name, monkeypatch):
    """T tasks x 5 lambda_t values are judged on models built from one merge of tau_MTL, not 5T merges."""
    from mergeflow.ml.merging import _tensors
    from mergeflow.ml.merging.search import choose_per_task

    merges = []  # the methods import map_stacked where they call it: they find this one
    real = _tensors.map_stacked
    monkeypatch.setattr(_tensors, "map_stacked", lambda *a, **k: merges.append(1) or real(*a, **k))
    theta0, tvs = _random_models()
    method = REGISTRY[name]
    fixed, _ = method.search_space({})
    chosen, curves = choose_per_task(method, {}, fixed, theta0, tvs, FakeEvaluator({t: 0.0 for t in tvs}))
    assert len(merges) == 1
    assert set(chosen["tall_lambda"]) == set(tvs) and all(len(c) == 5 for c in curves["tall_lambda"].values())


@pytest.mark.parametrize("n, k", [(1, 0.5), (10, 0.3), (1000, 0.2), (100_000, 0.01), (100_000, 0.999)])
def test_radix_topk_threshold_matches_sorting(n, k):
    from mergeflow.ml.merging.ties import topk_threshold

    g = torch.Generator().manual_seed(n)
    mags = torch.randn(n, generator=g).abs() * torch.rand(n, generator=g) ** 4  # spread over many exponents
    mags[: n // 3] = mags[0]  # ties across bucket boundaries
    n_keep = max(1, int(round(k * n)))
    expected = mags.sort(descending=True).values[min(n_keep, n) - 1]
    assert topk_threshold(mags, k, "round") == expected


@pytest.mark.parametrize("name", ["task_arithmetic", "ties", "dare_ties", "breadcrumbs", "magmax", "consensus_ties"])
def test_element_wise_merges_do_not_depend_on_the_thread_count(name):
    # the kernels split entries over threads; each entry is computed alone, in task order
    g = torch.Generator().manual_seed(3)
    theta0 = {
        "blocks.0.mlp.fc1.weight": torch.randn(64, 300, generator=g),
        "blocks.0.norm1.bias": torch.randn(300, generator=g),
    }
    tvs = {f"t{i}": {k: torch.randn(v.shape, generator=g) for k, v in theta0.items()} for i in range(5)}
    merged = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        merged[threads] = REGISTRY[name](theta0, tvs)
    assert all(torch.equal(merged[1][k], merged[2][k]) for k in theta0)


def test_read_stacks_holds_theta0_then_each_task_per_key_in_one_reused_buffer():
    from mergeflow.ml.merging._tensors import read_stacks

    theta0 = {"big": torch.arange(6.0).reshape(2, 3), "small": torch.tensor([7.0])}
    tvs = {t: {k: v + 10 * (i + 1) for k, v in theta0.items()} for i, t in enumerate(["a", "b"])}
    seen = []
    for key, stack in read_stacks(theta0, tvs):
        assert torch.equal(
            stack, torch.stack([theta0[key].reshape(-1), tvs["a"][key].reshape(-1), tvs["b"][key].reshape(-1)])
        )
        seen.append((key, stack.untyped_storage().data_ptr()))
    assert [k for k, _ in seen] == ["big", "small"] and seen[0][1] == seen[1][1]


def test_map_stacked_refuses_a_merge_that_returns_the_reused_buffer():
    from mergeflow.ml.merging._tensors import map_stacked

    theta0 = {"w": torch.zeros(3)}
    with pytest.raises(RuntimeError, match="'w'"):
        map_stacked(theta0, {"a": {"w": torch.ones(3)}}, lambda base, taus, states: base)
