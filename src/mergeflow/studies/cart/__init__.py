"""Study ``cart`` (seed 002, CART: "Revisiting weight averaging for model merging", Choi et al. 2024): do the seed's
measurements hold on our suite? It reads the standard fine-tune's outputs (vectors/, models/, data/tasks,
metrics/finetune, metrics/evaluate) and makes its own merges and evaluations; it trains nothing.

It is costly (about 60 merges and 260 evaluations: on the default suite, 2 CPU cores, MERGEFLOW_THREADS=1, 174 s
alone and 443-774 s beside a running test suite), so it is not in the default ``studies.run``. Run it with:

    dvc exp run -S 'studies.run=[gradients,mima,cart]'

Claims (the seed's numbers are its Figure 1, Section 4.2 / Appendix C, Tables 1 and 3 and Figure 7):

1. Accuracy against the rank ratio (lambda chosen on validation at every ratio): CART rises from weight averaging
   (WA), peaks at a low rank and returns to WA at full rank; low-rank task arithmetic (LRTA) rises to task
   arithmetic with no interior peak (Fig. 1).
2a. Row-space interference I(k) is lower for the centred task vectors theta_t - theta_avg than for the original
   tau_t at every layer and rank (Fig. 2, Fig. 8).
2b. The reconstruction error R(k) of the centred vectors falls steeply at low rank and then flattens, while I(k)
   keeps rising (Fig. 3).
3. CART-Indexing at 8% is within about a point of the individual models and above EMR (Table 3).
4. As the number of tasks T grows, WA, task arithmetic and TIES lose normalized accuracy faster than CART (Fig. 7;
   the issue calls it Figure 5).
5. The 8-task ranking is CART > Consensus TA > TIES > TA > WA (Table 1); the report gives the spectra of this
   backbone's task vectors (energy in the top 8% of the rank, per layer) as evidence for why it does or does not.

Definitions (seed eqs. 5 and 7, per matrix, k = ceil(ratio x min(m, n)) as the merge methods take it):
    I(k) = sum_{i != j} || S_i V_i^T V_j S_j ||_F, V_t the top-k right singular vectors (n x k) of the vector,
           S_t its top-k singular values divided by the l2 norm of all its singular values (= its Frobenius norm),
           so that I(k) grows with k to its full-rank value, as the seed's Fig. 3 shows. The seed's "normalized by
           their l2 norm" can also be read as dividing by the norm of the top k alone; claim 2a reports that
           reading's count too (its I(k) need not rise with k);
    R(k) = sum_t || c_t - SVD_k(c_t) ||_F^2 = sum_t sum_{s > k} sigma_{t,s}^2, c_t the centred vectors;
the report shows R(k) / R(0), the fraction of the centred vectors' energy not kept.

The study is a package, a module per part: ``settings``, ``spectra`` (the spectral measurements), ``measure`` (the
merges and evaluations), ``claims`` (the rules and the verdicts), ``figures`` and ``report`` (the study function,
registered as ``cart``, and the report's body).
"""

from __future__ import annotations

from mergeflow.studies.cart.claims import (
    claim_indexing,
    claim_interference,
    claim_rank_curve,
    claim_ranking,
    claim_scaling,
    claim_tradeoff,
    interior_peak,
    layer_medians,
    ranking,
    rises,
    rises_to_full,
    steep_then_flat,
)
from mergeflow.studies.cart.figures import plot_interference, plot_rank_curve, plot_scaling, plot_spectra, plot_tradeoff
from mergeflow.studies.cart.measure import Bench, draw_subsets, rank_sweep, scaling
from mergeflow.studies.cart.report import cart_study
from mergeflow.studies.cart.settings import NAMES, PAPER_8, PAPER_INDEXING, SCALING_METHODS, SEED_ORDER, CartSettings
from mergeflow.studies.cart.spectra import (
    LayerSpectra,
    energy_kept,
    interference,
    rank_of,
    reconstruction,
    spectra,
    svd_stack,
)

__all__ = [
    "Bench",
    "CartSettings",
    "LayerSpectra",
    "NAMES",
    "PAPER_8",
    "PAPER_INDEXING",
    "SCALING_METHODS",
    "SEED_ORDER",
    "cart_study",
    "claim_indexing",
    "claim_interference",
    "claim_rank_curve",
    "claim_ranking",
    "claim_scaling",
    "claim_tradeoff",
    "draw_subsets",
    "energy_kept",
    "interference",
    "interior_peak",
    "layer_medians",
    "plot_interference",
    "plot_rank_curve",
    "plot_scaling",
    "plot_spectra",
    "plot_tradeoff",
    "rank_of",
    "rank_sweep",
    "ranking",
    "reconstruction",
    "rises",
    "rises_to_full",
    "scaling",
    "spectra",
    "steep_then_flat",
    "svd_stack",
]
