"""The text suite's fixed lexicon (mergeflow.ml.data.text_suite): English function words and generated
pseudo-English content words, each role of each domain a list of meanings; a meaning is a tuple of its surface
words (one word each: the suite has no synonyms, whose relation a small model cannot learn from a small corpus).
Drawn once from a fixed seed: no task or seed changes it."""

from __future__ import annotations

import random

SPECIALS: tuple[str, ...] = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # RoBERTa's order: ids 0..4

FUNCTION = tuple(
    """the a some any every each this that these those many all two three four five six not never and
but because although while or after also than more less best good way place kind is are was were it has have do does
did can should will i we my who which what where when why how to of in on near with by there very really quite so
often keep makes color , . ?""".split()
)

# role meanings kind [suffixes]; kinds: n noun (+s), v verb (+s +ed +ing), a adjective, p name.
# sci.v is live, eat, hunt, migrate, discover.
_SPEC = """home.n 36 n|home.v 28 v|home.a 24 a|rev.n 28 n|rev.who 8 n|rev.pos 22 a|rev.neg 22 a|rev.vpos 6 v
|rev.vneg 6 v|rev.npos 6 n|rev.nneg 6 n|news.n 28 n|news.v 20 v|news.place 14 p ton/ford|news.day 7 p day
|scene.n 26 n|scene.v 18 v|scene.a 16 a|scene.place 12 n|forum.n 30 n|forum.v 22 v|forum.fault 8 v|forum.a 20 a
|travel.who 20 n|travel.n 24 n|travel.v 16 v|travel.a 16 a|travel.town 12 p wick/mouth|sci.n 30 n|sci.hab 12 n
|sci.food 16 n|sci.season 6 p tide|sci.part 10 n|sci.color 8 a|sci.who 10 p son/ski|sci.v 5 v|hist.who 30 n
|hist.v 20 v|hist.n 24 n|hist.place 14 p ham/stead"""
ROLES = {
    s[0]: (int(s[1]), s[2], s[3].split("/") if len(s) > 3 else None) for s in (x.split() for x in _SPEC.split("|"))
}
_FORMS = {"n": ("", "s"), "v": ("", "s", "ed", "ing"), "a": ("",), "p": ("",)}


def _lexicon():
    g = random.Random(0x7E47)  # fixed: the vocabulary never depends on a task's seed
    onset = "b bl br c ch cl cr d dr f fl fr g gl gr h j k l m n p pl pr r sh sk sl sn sp st t th tr v w z".split()
    nucleus, coda = "a e i o u ai ee oa ou".split(), "b ck d f g k l m n nd nk nt p r rk rn sk t x".split()
    taken, words, lex = set(SPECIALS) | set(FUNCTION), [], {}

    def fresh(kind, suffixes):
        while True:  # names and adjectives: one syllable and a suffix; nouns and verbs: two syllables
            w = "".join(g.choice(onset) + g.choice(nucleus) for _ in range(1 if kind in "ap" else 2)) + g.choice(coda)
            w += g.choice(suffixes or (("ish", "y", "ful", "al", "ic") if kind == "a" else ("",)))
            if not taken.intersection(forms := [w + f for f in _FORMS[kind]]):
                taken.update(forms)
                words.extend(forms)
                return w

    for role, (n, kind, suffixes) in ROLES.items():
        lex[role] = [(fresh(kind, suffixes),) for _ in range(n)]
    return words, lex


WORDS, LEX = _lexicon()


def n(role):
    return len(LEX[role])


def pick(r, role, m=None):
    """The surface word of meaning m, or of a random meaning, of a lexicon role."""
    ms = LEX[role]
    return r.choice(ms[r.randrange(len(ms))] if m is None else ms[m])


def other(r, x, k, avoid=()):
    """A random value in range(k) other than x and those in avoid."""
    return r.choice([i for i in range(k) if i != x and i not in avoid])


# every domain's noun, verb and adjective stems, so that a uniform draw reaches every word
DOMAINS = [
    tuple(
        [w for k, v in ROLES.items() if k.split(".")[0] == d and v[1] == kind for m in LEX[k] for w in m]
        for kind in "nva"
    )
    for d in ("home", "rev", "news", "scene", "forum", "travel", "sci", "hist")
]
