"""Study ``cart``'s settings and the seed's published numbers it compares with."""

from __future__ import annotations

from pydantic import Field, model_validator

from mergeflow.studies import StudySettings

# Seed 002, Table 1 (ViT-B/32, 8 tasks, average absolute accuracy %) and Table 3 (CART-Indexing at 8%, EMR)
PAPER_8 = {
    "weight_averaging": 65.9,
    "task_arithmetic": 69.1,
    "ties": 72.4,
    "consensus_ta": 75.2,
    "cart": 84.7,
    "individual": 90.5,
}


PAPER_INDEXING = {"cart_indexing": 90.1, "emr": 88.8, "individual": 90.5}


# Seed 002, Table 2 (RoBERTa-base on GLUE's eight tasks, GLUE's metric per task, average %)
PAPER_GLUE = {"weight_averaging": 51.34, "task_arithmetic": 66.65, "ties": 64.04, "cart": 70.78, "individual": 85.56}
GLUE_ORDER = ["cart", "task_arithmetic", "ties", "weight_averaging"]


SEED_ORDER = ["cart", "consensus_ta", "ties", "task_arithmetic", "weight_averaging"]


NAMES = {
    "cart": "CART",
    "consensus_ta": "Consensus TA",
    "ties": "TIES",
    "task_arithmetic": "TA",
    "weight_averaging": "WA",
    "low_rank_ta": "LRTA",
    "cart_indexing": "CART-Indexing",
    "emr": "EMR",
    "individual": "individual",
}


SCALING_METHODS = ["weight_averaging", "task_arithmetic", "ties", "cart"]


class CartSettings(StudySettings):
    # claim 1: the rank ratios k / min(m, n) swept for CART and low-rank task arithmetic (0 and 1 are the endpoints)
    ratios: list[float] = [0.0, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.0]
    # claims 1 and 4: CART's lambda grid, coarser than merge.cart's (searched on validation at every ratio / subset)
    cart_lambdas: list[float] = [0.8, 1.6, 2.4, 3.2]
    # claims 1 and 4: task arithmetic's and low-rank task arithmetic's lambda grid
    ta_lambdas: list[float] = [0.2, 0.4, 0.6, 0.8, 1.0]
    # claim 4: TIES' lambda grid (its k and trim scope come from merge.ties in params.yaml)
    ties_lambdas: list[float] = [0.8, 1.2, 1.6, 2.0]
    # claims 3, 4 and 5: CART's rank ratio (the seed's 8%)
    rank_ratio: float = Field(0.08, gt=0, le=1)
    # claim 4: subset sizes T (a size above the suite's task count is dropped; the full suite has one subset)
    subset_sizes: list[int] = [2, 4, 6, 8]
    # claim 4: random subsets per size (distinct; fewer when fewer exist)
    subsets_per_size: int = Field(3, ge=1)
    # claim 4: seed of the subset draw
    seed: int = 0
    # claim 1: CART at ratio 0 and 1 must be within this of weight averaging (fractions; they are WA analytically)
    endpoint_tolerance: float = Field(0.005, ge=0)
    # claim 1: an interior peak must beat both endpoints by at least this (fraction: 0.01 = 1 point); LRTA "has no
    # interior peak" when no interior ratio beats its full-rank accuracy by more than this
    peak_margin: float = Field(0.01, ge=0)
    # claim 1: "a low rank": CART's best ratio must be at most this
    low_rank_max: float = Field(0.16, gt=0, le=1)
    # claim 2a: the fraction of (layer, rank > 0) points where centred I(k) < original I(k) must be at least this
    # (1.0: every layer and rank, as the claim says)
    interference_fraction: float = Field(1.0, ge=0, le=1)
    # claim 2b: the knee: R(k) / R(0) (median over layers) must fall at least `steepness` times faster per unit of
    # rank ratio on [0, knee] than on [knee, 1] ...
    knee_ratio: float = Field(0.08, gt=0, lt=1)
    steepness: float = Field(3.0, gt=0)
    # ... and the median I(k) of the centred vectors must rise over the ratios from the knee to 1, no step down by
    # more than this (relative to the previous value; 0: monotone)
    interference_slack: float = Field(0.0, ge=0)
    # claim 3: CART-Indexing may be at most this below the individual models' average test accuracy (fraction)
    indexing_tolerance: float = Field(0.01, ge=0)
    # claim 2 figures: the layer shown alone (as the seed's Figs. 2 and 3); the first matrix when absent
    example_layer: str = "blocks.1.mlp.fc1.weight"

    @model_validator(mode="after")
    def _check(self) -> CartSettings:
        if (
            sorted(set(self.ratios)) != list(self.ratios)
            or self.ratios[0] != 0.0
            or self.ratios[-1] != 1.0
            or len(self.ratios) < 3
        ):
            raise ValueError("ratios: ascending, distinct, from 0.0 to 1.0, with an interior ratio")
        if not all(0 < r < 1 for r in self.ratios[1:-1]):
            raise ValueError("ratios: interior ratios within (0, 1)")
        for name in ("cart_lambdas", "ta_lambdas", "ties_lambdas"):
            if not getattr(self, name):
                raise ValueError(f"{name}: at least one value")
        if sorted(set(self.subset_sizes)) != list(self.subset_sizes) or min(self.subset_sizes, default=0) < 2:
            raise ValueError("subset_sizes: ascending, distinct, each at least 2")
        return self
