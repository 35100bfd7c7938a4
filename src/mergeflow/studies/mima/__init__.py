"""Study ``mima`` (seed 001, MIMA: iterative model averaging and fine-tuning): do the seed's measurements hold on
our suite? It reads the pipeline's outputs only (no training): the standard fine-tune as N = 1 (or the regime's
``mima_n1`` variant when it ran; the two are the same run bit for bit), and regime@mima's variants ``mima_n<N>``
for the round counts in ``regimes.mima.rounds``.

Claims (the seed's numbers are its Table 1, Figure 5 and Appendix C):

1. At N = 1 the pairwise cosines of the task vectors tau_t are near 0-0.1, and their median rises with N (Fig. 5).
2. Related tasks (MNIST / SVHN there, digits / house_numbers here) have a higher N = 1 cosine than the other pairs (Fig.
   10).
3. UA accuracy rises with N while the individual models' accuracy changes little (Table 1, Fig. 8).
4. The gap individual - UA shrinks with N (Fig. 6); task arithmetic's and TIES' advantage over UA shrinks with N
   (Fig. 4a); task arithmetic's chosen lambda falls toward 1/T (Table 2; lambda = 1/T is UA).
5. The per-round updates delta_t(i) of different tasks stay near-orthogonal while cos(tau_t(i)) rises with round i
   (Appendix C.2, Fig. 11), from the per-round records of the largest N.

"Rises" over a sequence (N ascending, or rounds): no step goes down by more than the slack setting and the last
value is above the first; "shrinks" is the mirror. A claim needs two round counts (two rounds for claim 5) with
its numbers, else it is not measured.

The study is a package, a module per part: ``measure`` (its settings and the measurements), ``claims``, ``figures``
and ``report`` (the study function, registered as ``mima``).
"""

from mergeflow.studies.mima.claims import rises, shrinks
from mergeflow.studies.mima.measure import MimaSettings, Point, collect
from mergeflow.studies.mima.report import mima_study

__all__ = ["MimaSettings", "Point", "collect", "mima_study", "rises", "shrinks"]
