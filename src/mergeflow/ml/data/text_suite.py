"""Embedded generated text task suite: a masked-LM pretraining corpus and eight GLUE-like downstream tasks.

Word-level over one fixed vocabulary (English function words and generated pseudo-English content words, no
synonyms: ``_text_lexicon``), generated with the standard library's ``random``, deterministically from a seed (the
generators: ``_text_tasks``).  The design goal is that of ``embedded.py``, for text: a *merging* benchmark for a
small RoBERTa-style encoder pretrained on ``make_corpus``.  Fine-tuning must clearly beat a linear probe on the
frozen features, so every task needs composition (word order, scope of negation, agreement, comparing two
sentences) rather than a bag of words; and it must be learnable by a 4-layer encoder from about 3000 examples in a
few hundred steps.  Measured: this encoder does not learn to match content words across the two sentences in 300
steps (a changed noun or verb, swapped roles: even with 6 words a slot, or 1500 steps, near chance on held-out
pairs), so most pair decisions combine features of the two sentences that a word's class gives (negation, tense,
voice, question intent, "more"/"less", a present or missing modifier: an XOR or a comparison across the pair, which
neither a bag of words nor the frozen <s> feature reads linearly), and a minority needs the word matching (swapped
roles, a changed slot word).  No synonyms and no taxonomy: lexical relations the model would have to learn from
corpus facts are not learnt at this scale.  Task vectors should interfere only moderately, so each task lives
mostly in its own domain vocabulary and shares only the function words and the grammar, as on GLUE.

Pretraining corpus (no labels; pairs only as one line)
    One side of the tasks' examples (grammatical sentences only), generic sentences in every noun and verb form of
    every domain, agreeing pairs of the pair tasks joined into one line (a paraphrase, an entailment, a question
    and its answer), so that masked words are read off the other half, and restatements of the patterns the tasks
    use ("the A Ved the B , so the B was Ved by the A", "a A is more P than a B , so a B is less P than a A").

Downstream tasks (GLUE counterpart, label: what deciding it needs; domain)
  acceptability  CoLA   ok or not (30%): agreement across relative clauses, determiner number, word order; home
  sentiment      SST-2  negative/positive: polarity word XOR negation; the clause after "but" decides; reviews
  paraphrase     MRPC   same event: passive voice, "not"/"never" and moved modifiers keep it; negation, tense
                        (past/future), an added or dropped place or day, swapped roles (same words), rarely another
                        verb or participant break it; news
  similarity     STS-B  0-5: 5 minus weighted meaning differences (negation 2, tense 1.5, a dropped or added
                        object, place or adjective, number; rarely swapped roles or another word), small noise;
                        unrelated pairs across domains; scenes, news
  duplicates     QQP    same question: "how do i X" = "what is the best way to X" != "where can i X"; "why does my
                        X keep Ving" != "why does my X never V"; "is A more P than B" = "is B less P than A" !=
                        "is B more P than A"; rarely another slot word; forum
  inference      MNLI   entailment/neutral/contradiction: dropped or added adjectives and places, upward monotone,
                        downward under negation; rarely another person, verb or object (neutral); travel
  answerable     QNLI   does the sentence answer: the asked relation (where/what/when/how many/who) must be stated
                        of the asked entity (who hunts whom); science
  entailment     RTE    entailed or not: the hypothesis restates one fact of a two-fact premise (relative clauses,
                        passives, "A did not V the O , but B did") with its polarity or the other; history, travel;
                        1/4 data
    Related pairs: paraphrase <-> duplicates <-> similarity (negation, tense, reordering and swaps; similarity
    shares the news and scene words, duplicates the scene words); inference <-> entailment (facts about people,
    verbs and objects, travel words).  acceptability and sentiment stand alone.  No label noise except
    similarity's score noise.

Measured (AMD EPYC, 2 cores; profiles/text8.yaml, seed 0: 60000 corpus lines, 1000 masked-LM steps, 3000 train /
200 val / 500 test, the probe at C 0.1, 300 fine-tuning steps; docs/text-suite.md has the whole run).  Bag of words:
logistic regression (ridge for similarity) on the two sentences' binary bags of words, 2000 train; probe: a linear
head on the frozen pretrained <s> feature; fine-tuned: the backbone and head trained together (test scores; MCC,
accuracy, (accuracy + F1) / 2, or (Pearson + Spearman) / 2, as on GLUE):
                 acceptab  sentiment  paraphr  similar  duplic  inference  answerab  entailm   average
  bag of words     0.17      0.60      0.53     0.07     0.57     0.40       0.53      0.54
  probe            0.25      0.55      0.63     0.37     0.64     0.64       0.66      0.61      0.55
  fine-tuned       0.71      0.99      0.77     0.67     0.79     0.81       0.75      0.75      0.78
  Merging (test average): weight averaging 0.41, task arithmetic 0.44, TIES 0.37, CART 0.45.
  The fine-tuned scores moved by up to 0.15 between pretraining runs while the suite was built.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass

import numpy as np

from mergeflow.ml.data._text_lexicon import DOMAINS, FUNCTION, SPECIALS, WORDS, pick
from mergeflow.ml.data._text_tasks import GENERATORS, _acceptability


@dataclass(frozen=True)
class TextTask:
    name: str
    kind: str  # "classification" | "regression"
    classes: tuple[str, ...]  # class names; regression: ("score",)
    metric: str  # "matthews" | "accuracy" | "accuracy_f1" | "pearson_spearman"
    pair: bool  # two sentences per example
    train_share: float  # fraction of n_train this task generates
    glue: str  # the GLUE task it mirrors


_C = "classification"
TASKS: dict[str, TextTask] = {
    t.name: t
    for t in (
        TextTask("acceptability", _C, ("unacceptable", "acceptable"), "matthews", False, 1.0, "CoLA"),
        TextTask("sentiment", _C, ("negative", "positive"), "accuracy", False, 1.0, "SST-2"),
        TextTask("paraphrase", _C, ("not_paraphrase", "paraphrase"), "accuracy_f1", True, 1.0, "MRPC"),
        TextTask("similarity", "regression", ("score",), "pearson_spearman", True, 1.0, "STS-B"),
        TextTask("duplicates", _C, ("not_duplicate", "duplicate"), "accuracy_f1", True, 1.0, "QQP"),
        TextTask("inference", _C, ("entailment", "neutral", "contradiction"), "accuracy", True, 1.0, "MNLI"),
        TextTask("answerable", _C, ("not_answerable", "answerable"), "accuracy", True, 1.0, "QNLI"),
        TextTask("entailment", _C, ("not_entailment", "entailment"), "accuracy", True, 0.25, "RTE"),
    )
}

# the longest sentence each task's templates build (make_task rejects longer ones, so this is a guarantee)
_MAX = {
    "acceptability": 16,
    "sentiment": 17,
    "paraphrase": 14,
    "similarity": 13,
    "duplicates": 11,
    "inference": 11,
    "answerable": 15,
    "entailment": 18,
}


def vocabulary() -> list[str]:
    """SPECIALS first (RoBERTa's ids 0..4), then the function words, then every content word form, each once."""
    return list(SPECIALS) + list(FUNCTION) + WORDS


def max_words(task: str) -> int:
    """The most words one sentence of an example (each of a pair's) can have."""
    return _MAX[task]


def make_task(task: str, n_train: int, n_val: int, n_test: int, seed: int) -> dict:
    """{"train_a", "train_b", "train_y", "val_*", "test_*"}: sentences as word lists (b None for single-sentence
    tasks), labels int64 class ids (float32 scores for regression); no example occurs twice."""
    if task not in TASKS:
        raise ValueError(f"unknown text task {task!r}: one of {', '.join(TASKS)}")
    t, gen, lim = TASKS[task], GENERATORS[task], _MAX[task]
    r, seen, out = random.Random(zlib.crc32(task.encode()) * 1_000_003 + seed), set(), {}
    for split, k in (("train", max(8, round(n_train * t.train_share))), ("val", n_val), ("test", n_test)):
        ex, misses = [], 0
        while len(ex) < k:
            a, b, y = gen(r)
            if (key := (tuple(a), tuple(b or ()))) in seen or len(a) > lim or len(b or ()) > lim:
                misses += 1
                if misses > 20 * k + 1000:
                    raise ValueError(f"{task}: cannot make {k} distinct {split} examples")
                continue
            seen.add(key)
            ex.append((a, b, y))
        out[f"{split}_a"], out[f"{split}_b"] = [e[0] for e in ex], [e[1] for e in ex] if t.pair else None
        out[f"{split}_y"] = np.asarray([e[2] for e in ex], np.float32 if t.kind == "regression" else np.int64)
    return out


# ----------------------------------------------------------------------------- the corpus

_DET = {False: ("the", "a", "every", "this", "that", "each"), True: ("the", "some", "these", "those", "many", "all")}
_SIDES = [(t, i) for t in GENERATORS if t != "acceptability" for i in (0, 1) if i == 0 or TASKS[t].pair]


def _generic(r):
    """A plain sentence or question of one domain with a verb in any of its four forms (so that every form is seen)."""
    ns, vs, adjs = r.choice(DOMAINS)
    form, v, k = r.choice(("", "s", "ed", "ing")), r.choice(vs), r.random()
    pl = form == "" or form != "s" and r.random() < 0.5
    subj = [r.choice(_DET[pl])] + [r.choice(adjs or [""])] * (bool(adjs) and r.random() < 0.3)
    subj += [r.choice(ns) + "s" * pl]
    obj = ["the", r.choice(ns) + "s" * (r.random() < 0.5)]
    if k < 0.15:  # questions
        return (
            ["who", v + "ed"] + obj
            if form == "ed"
            else ["what", "do"] + subj + [v]
            if form == ""
            else ["what", "is" if form == "s" else "are"] + subj + [v + "ing"]
        ) + ["?"]
    if form == "":
        vp = r.choice(([v], ["do", "not", v], ["will", v]))
    else:
        vp = ["are" if pl else "is", v + "ing"] if form == "ing" else [v + form]
    end = r.choice(
        (
            [],
            [],
            [r.choice(("because", "although", "while")), "it", "was", r.choice(("very", "quite")), "good"],
            [r.choice(("to", "of", "with", "near", "in")), "the", r.choice(ns)],
            ["of", "a", "good", "kind"],
        )
    )
    return subj + vp + obj + end + ["."]


def _restatement(r):
    """One statement and a restatement of it: the patterns (voice, comparison, monotonicity) the pair tasks use."""
    k = r.randrange(4)
    if k == 0:  # voice
        dom = r.choice(("news", "hist", "travel", "scene"))
        nr, vr = {"hist": ("hist.n", "hist.v"), "travel": ("travel.n", "travel.v")}.get(dom, (dom + ".n", dom + ".v"))
        ar = {"hist": "hist.who", "travel": "travel.who"}.get(dom, nr)
        a, p, v = ["the", pick(r, ar)], ["the", pick(r, nr)], pick(r, vr)
        act, pas = a + [v + "ed"] + p, p + ["was", v + "ed", "by"] + a
        return (act + [",", "so"] + pas if r.random() < 0.5 else pas + [",", "so"] + act) + ["."]
    if k == 1:  # comparison
        dom = r.choice(("forum", "scene"))
        o1, o2, adj = pick(r, dom + ".n"), pick(r, dom + ".n"), pick(r, "forum.a")
        s = [["a", o1, "is", "more", adj, "than", "a", o2], ["a", o2, "is", "less", adj, "than", "a", o1]]
        r.shuffle(s)
        return s[0] + [",", "so"] + s[1] + ["."]
    if k == 2:  # monotonicity: a dropped modifier (positive) or an added one (negated)
        s, v, o = ["the", pick(r, "travel.who")], pick(r, "travel.v"), pick(r, "travel.n") + "s"
        mod = r.choice(([pick(r, "travel.a"), o], [o, "in", pick(r, "travel.town")]))
        if r.random() < 0.5:
            return s + [v + "ed", "some"] + mod + [",", "so"] + s + [v + "ed", "some", o, "."]
        return s + ["never", v + "ed", "any", o, ",", "so"] + s + ["never", v + "ed", "any"] + mod + ["."]
    dom = r.choice(("forum", "scene"))  # questions of one intent
    v, o = pick(r, dom + ".v"), pick(r, dom + ".n")
    q = r.sample((["how", "do", "i"], ["how", "can", "i"], ["what", "is", "the", "best", "way", "to"]), 2)
    return q[0] + [v, "a", o, ",", "that", "is", ","] + q[1] + [v, "a", o, "?"]


_PAIRED = ("paraphrase", "similarity", "duplicates", "inference", "answerable", "entailment")


def _paired(r):
    """A pair task's two sentences in one line where they agree (a paraphrase, an entailment, an answer), so that
    masked words must be read off the other half: it teaches the cross-sentence matching the pair tasks use."""
    t = r.choice(_PAIRED)
    while True:
        a, b, y = GENERATORS[t](r)
        if (y >= 4 if t == "similarity" else y == 0 if t == "inference" else y == 1) and len(a) + len(b) <= 21:
            if a[-1] == "?":
                return a + b  # a question and its duplicate or its answer
            return a[:-1] + ([",", "so"] if t in ("inference", "entailment") else [",", "that", "is", ","]) + b


def make_corpus(n_sentences: int, seed: int) -> list[list[str]]:
    """The masked-LM pretraining corpus: grammatical sentences and questions over all domains, no labels, no pairs
    (but agreeing sentence pairs joined into one line)."""
    r, out = random.Random(0xC0 * 1_000_003 + seed), []
    for _ in range(n_sentences):
        if (c := r.random()) < 0.45:  # one side of a task example (acceptability: a grammatical sentence)
            t, i = r.choice(_SIDES)
            out.append(_acceptability(r, "")[0] if r.random() < 1 / 9 else GENERATORS[t](r)[i])
        else:
            out.append(_generic(r) if c < 0.75 else _paired(r) if c < 0.92 else _restatement(r))
    return out
