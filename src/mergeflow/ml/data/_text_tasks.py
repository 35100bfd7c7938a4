"""The text suite's eight generators (mergeflow.ml.data.text_suite): each draws one example, (a, b, label), from a
``random.Random``; b is None for the single-sentence tasks.  The pair tasks compare two sentences whose relevant
words mostly occur in both (word order, swapped roles, voice, negation, a dropped or changed slot word), so that
deciding them takes composition a small encoder can learn from a few thousand examples, and no lexical relation
it would have to learn from corpus facts."""

from __future__ import annotations

from mergeflow.ml.data._text_lexicon import n, other, pick

# ----------------------------------------------------------------------------- acceptability (CoLA)

_DET = {False: ("the", "a", "every", "this", "that", "each"), True: ("the", "some", "these", "those", "many", "all")}
_WRONG = {False: ("these", "those", "many", "all"), True: ("a", "every", "each", "this", "that")}  # by noun number


def _np(r, pl, dets=None):
    return [r.choice(dets or _DET[pl])] + [pick(r, "home.a")] * (r.random() < 0.35) + [pick(r, "home.n") + "s" * pl]


def _acceptability(r, fault=None):
    """A sentence of the home domain with the violation `fault` built in ("" for none; None: a random one, 30%)."""
    if fault is None:
        fault = r.choices(("agree", "order", "det", "form", "drop"), (4, 2, 1.5, 1.5, 1))[0] if r.random() < 0.3 else ""
    kind = r.choice((3, 4) if fault == "form" else (1, 2, 3, 5) if fault == "drop" else (1, 2, 3, 4, 5))
    pl, rc = r.random() < 0.5, []
    in_rc = fault == "agree" and kind < 4 and r.random() < 0.15  # break the relative clause's agreement instead
    agree = pl ^ (fault == "agree" and not in_rc)  # the number the main verb shows
    subj = _np(r, pl, _WRONG[pl] if fault == "det" else (("a",), ("some", "many"))[pl] if kind == 5 else None)
    if kind < 4 and (in_rc or r.random() < 0.5):  # relative clauses put an attractor noun before the main verb
        x = r.random() < 0.5
        if r.random() < 0.5:
            rc = ["who", pick(r, "home.v") + "s" * (not pl ^ in_rc)] + _np(r, x)
        else:
            rc = ["that"] + _np(r, x) + [pick(r, "home.v") + "s" * (not x ^ in_rc)]
    v, obj, c = pick(r, "home.v"), _np(r, r.random() < 0.5), r.random()
    vb = v + r.choice(("s", "ed")) if fault == "form" else v
    pp = [r.choice(("in", "on", "near", "with")), "the", pick(r, "home.n") + "s" * (c < 0.2)] * (c < 0.4)
    aux, cop, head = ("do" if agree else "does"), ("are" if agree else "is"), subj + rc
    w, i = {
        1: lambda: (head + [v + "s" * (not agree)] + obj + pp + ["."], len(head)),
        2: lambda: (
            head
            + [cop]
            + ["not"] * (r.random() < 0.3)
            + ["very"] * (r.random() < 0.3)
            + [pick(r, "home.a")]
            + pp
            + ["."],
            len(head),
        ),
        3: lambda: (head + [aux, "not", vb] + obj + ["."], len(head)),
        4: lambda: ([aux] + subj + [vb] + obj + ["?"], 0),
        5: lambda: (["there", cop] + subj + pp + ["."], 1),
    }[kind]()
    if fault == "drop":  # the main verb
        del w[i]
    elif fault == "order":  # swap two different neighbours (never "there is" into a question)
        j = r.choice([j for j in range(kind == 5, len(w) - 1) if w[j] != w[j + 1]])
        w[j], w[j + 1] = w[j + 1], w[j]
    return w, None, int(not fault)


# ----------------------------------------------------------------------------- sentiment (SST-2)


def _clause(r, pol):
    """A clause of polarity pol: its polarity word has polarity pol XOR its negation."""
    neg, pl, k = r.random() < 0.35, r.random() < 0.35, r.random()
    lex = pol ^ neg
    subj = [r.choice(("the", "these", "those") if pl else ("the", "this", "that")), pick(r, "rev.n") + "s" * pl]
    cop = r.choice(("are", "were") if pl else ("is", "was"))
    if k < 0.5:
        return (
            subj
            + [cop]
            + [r.choice(("not", "never"))] * neg
            + [r.choice(("very", "really", "quite", "so"))] * (r.random() < 0.4)
            + [pick(r, ("rev.neg", "rev.pos")[lex])]
        )
    if k < 0.8:
        who = r.choice((["i"], ["we"], ["the", pick(r, "rev.who") + "s" * (r.random() < 0.5)]))
        v = pick(r, ("rev.vneg", "rev.vpos")[lex])
        return who + ((["did", "not", v] if r.random() < 0.6 else ["never", v + "ed"]) if neg else [v + "ed"]) + subj
    noun = pick(r, ("rev.nneg", "rev.npos")[lex])
    return subj + [cop] + ["not"] * neg + ([noun + "s"] if pl else ["a", noun])


def _sentiment(r):
    y, f = int(r.random() < 0.5), r.random()
    if f < 0.4:
        w = _clause(r, y)
    elif f < 0.7:  # "X but Y": Y decides, X mostly of the other polarity
        w = _clause(r, 1 - y if r.random() < 0.8 else y) + ["but"] + _clause(r, y)
    elif f < 0.85:
        w = ["although"] + _clause(r, 1 - y) + [","] + _clause(r, y)
    else:
        w = _clause(r, y) + [r.choice(("and", "because"))] + _clause(r, y)
    return w + ["."], None, y


# ----------------------------------------------------------------------------- paraphrase (MRPC)


def _news_words(r, e):
    """One realisation of an event: past (active or passive) or future, negation as "not" or "never", the
    modifiers at the end or fronted."""
    ag, v, pt, place, day, neg, fut = e
    a, p, vb = ["the", pick(r, "news.n", ag)], ["the", pick(r, "news.n", pt)], pick(r, "news.v", v)
    if fut:
        core = a + ["will"] + [r.choice(("not", "never"))] * neg + [vb] + p
    elif r.random() < 0.6:
        core = a + (r.choice((["did", "not", vb], ["never", vb + "ed"])) if neg else [vb + "ed"]) + p
    else:
        core = p + ["was"] + [r.choice(("not", "never"))] * neg + [vb + "ed", "by"] + a
    mods = [["in", pick(r, "news.place", place)]] * (place is not None)
    mods += [["on", pick(r, "news.day", day)]] * (day is not None)
    r.shuffle(mods)
    if mods and r.random() < 0.3:
        return mods[0] + [","] + core + sum(mods[1:], []) + ["."]
    return core + sum(mods, []) + ["."]


def _paraphrase(r):
    # an event: agent, verb, patient, place, day, negated, future
    (ag, pt), y = r.sample(range(n("news.n")), 2), int(r.random() < 0.5)
    e = [
        ag,
        r.randrange(n("news.v")),
        pt,
        r.randrange(n("news.place")) if r.random() < 0.5 else None,
        r.randrange(n("news.day")) if r.random() < 0.5 else None,
        r.random() < 0.4,
        r.random() < 0.4,
    ]
    f = list(e)
    k = "" if y else r.choices(("swap", "verb", "arg", "mod", "neg", "tense"), (1, 0.4, 0.4, 2, 3, 3))[0]
    if k == "swap":
        f[0], f[2] = f[2], f[0]
    elif k == "verb":
        f[1] = other(r, f[1], n("news.v"))
    elif k == "arg":
        f[r.choice((0, 2))] = other(r, f[0], n("news.n"), (f[2],))
    elif k == "mod":  # a place or day added or dropped (rarely changed)
        i = r.choice((3, 4))
        size = (n("news.place"), n("news.day"))[i - 3]
        f[i] = (
            None
            if f[i] is not None and r.random() < 0.7
            else r.randrange(size)
            if f[i] is None
            else other(r, f[i], size)
        )
    elif k:
        f[5 if k == "neg" else 6] ^= True
    return _news_words(r, e), _news_words(r, f), y


# ----------------------------------------------------------------------------- similarity (STS-B)


def _scene_meaning(r, news=None):
    news = r.random() < 0.3 if news is None else news
    s, o = r.sample(range(n("news.n" if news else "scene.n")), 2)
    return dict(
        news=news,
        s=s,
        pl=r.random() < 0.3,
        adj=r.randrange(n("scene.a")) if r.random() < 0.5 else None,
        v=r.randrange(n("news.v" if news else "scene.v")),
        o=o if r.random() < 0.7 else None,
        place=r.randrange(n("news.place" if news else "scene.place")) if r.random() < 0.6 else None,
        neg=r.random() < 0.3,
        past=r.random() < 0.4,
    )


def _scene_words(r, m):
    """A caption: progressive or simple, present or past, the place at the end or fronted."""
    nr, vr, prr = ("news.n", "news.v", "news.place") if m["news"] else ("scene.n", "scene.v", "scene.place")
    pl, neg, v = m["pl"], m["neg"], pick(r, vr, m["v"])
    subj = (
        [r.choice(("two", "some", "the") if pl else ("a", "the"))]
        + [pick(r, "scene.a", m["adj"])] * (m["adj"] is not None)
        + [pick(r, nr, m["s"]) + "s" * pl]
    )
    if r.random() < 0.6:
        vp = [("were" if pl else "was") if m["past"] else "are" if pl else "is"] + ["not"] * neg + [v + "ing"]
    elif m["past"]:
        vp = ["did", "not", v] if neg else [v + "ed"]
    else:
        vp = ["do" if pl else "does", "not", v] if neg else [v + "s" * (not pl)]
    obj = [r.choice(("a", "the")), pick(r, nr, m["o"])] * (m["o"] is not None)
    loc = []
    if m["place"] is not None:  # the preposition belongs to the place, so it never changes alone
        loc = [("in", "on", "near")[m["place"] % 3]] + ["the"] * (not m["news"]) + [pick(r, prr, m["place"])]
    if loc and r.random() < 0.25:
        return loc + [","] + subj + vp + obj + ["."]
    return subj + vp + obj + loc + ["."]


# the cost of each difference (swapping s and o: 2.0) and how often an edit makes it
_COST = {"adj": 0.8, "place": 1.0, "pl": 0.6, "o": 1.2, "v": 1.6, "s": 1.6, "neg": 2.0, "past": 1.5}
_EDITS = {"adj": 2, "place": 2, "pl": 2, "o": 2, "v": 0.4, "s": 0.4, "neg": 3, "past": 3, "swap": 0.5}


def _similarity(r):
    m = _scene_meaning(r)
    if r.random() < 0.12:  # an unrelated pair: the other domain
        return _scene_words(r, m), _scene_words(r, _scene_meaning(r, not m["news"])), r.uniform(0, 0.6)
    f, k, d = dict(m), n("news.n" if m["news"] else "scene.n"), "news" if m["news"] else "scene"
    for _ in range(r.choices((0, 1, 2, 3), (18, 34, 28, 20))[0]):
        e = r.choices(list(_EDITS), list(_EDITS.values()))[0]
        if e == "swap" and f["o"] is not None:
            f["s"], f["o"] = f["o"], f["s"]
        elif e in ("pl", "neg", "past"):
            f[e] = not f[e]
        elif e in ("adj", "place", "o") and (f[e] is None or r.random() < 0.7):  # added or dropped
            size = {"adj": n("scene.a"), "place": n(d + ".place")}.get(e, k)
            f[e] = None if f[e] is not None else other(r, f["s"], size) if e == "o" else r.randrange(size)
        elif e != "swap":
            size = {"adj": n("scene.a"), "place": n(d + ".place"), "v": n(d + ".v")}.get(e, k)
            f[e] = other(r, f[e], size, (f["s"], f["o"]) if e in "so" else ())
    # the score is a function of the two meanings (not of the edits), so equal pairs get equal scores
    swap = f["o"] is not None and (f["s"], f["o"]) == (m["o"], m["s"])
    cost = sum(c for k, c in _COST.items() if f[k] != m[k] and not (swap and k in "so")) + 2.0 * swap
    return _scene_words(r, m), _scene_words(r, f), min(5.0, max(0.0, 5 - cost + r.gauss(0, 0.15)))


# ----------------------------------------------------------------------------- duplicates (QQP)


def _q_meaning(r):
    dom, a = "scene" if r.random() < 0.25 else "forum", r.randrange(n("forum.a"))
    k = r.choices(("how", "where", "why", "cmp", "which"), (3, 2, 2.5, 0.8, 1))[0]
    o, o2 = r.sample(range(n(dom + ".n")), 2)
    if k in ("how", "where"):
        return k, dom, r.randrange(n(dom + ".v")), o
    if k == "why":
        return k, dom, r.randrange(n("forum.fault")), o, r.random() < 0.3
    if k == "cmp":  # o is more a than o2: "is o more a than o2" = "is o2 less a than o"
        return k, dom, o, o2, a
    return k, dom, min(o, o2), max(o, o2), a  # which: the order of the two options does not matter


def _q_words(r, m):
    """One phrasing of a question meaning."""
    k, dom, on = m[0], m[1], lambda i: pick(r, m[1] + ".n", i)
    if k == "how":
        return (
            r.choice(
                (
                    ["how", "do", "i"],
                    ["how", "can", "i"],
                    ["what", "is", "the", "best", "way", "to"],
                    ["how", "should", "i"],
                )
            )
            + [pick(r, dom + ".v", m[2]), r.choice(("a", "my", "the"))]
            + [on(m[3]), "?"]
        )
    if k == "where":
        return r.choice((["where", "can", "i"], ["where", "do", "i"], ["what", "is", "a", "good", "place", "to"])) + [
            pick(r, dom + ".v", m[2]),
            "a",
            on(m[3]),
            "?",
        ]
    if k == "why":
        f, o = pick(r, "forum.fault", m[2]), on(m[3])
        if m[4]:
            return ["why", r.choice(("does", "will")), "my", o, r.choice(("not", "never")), f, "?"]
        return r.choice(
            (
                ["why", "does", "my", o, "keep", f + "ing"],
                ["why", "does", "my", o, f, "so", "often"],
                ["what", "makes", "my", o, f],
            )
        ) + ["?"]
    if k == "cmp":
        (o1, o2), cmp = (m[2:4], "more") if r.random() < 0.5 else ((m[3], m[2]), "less")
        return ["is", "a", on(o1), cmp, pick(r, "forum.a", m[4]), "than", "a", on(o2), "?"]
    o1, o2 = r.sample(m[2:4], 2)
    return ["which", "is", "more", pick(r, "forum.a", m[4]), ",", "a", on(o1), "or", "a", on(o2), "?"]


def _q_other(r, m):
    """A different question meaning, mostly a near miss of m (the intent, the negation or the order changed; rarely
    one slot word)."""
    k, dom, no, c = *m[:2], n(m[1] + ".n"), r.random()
    if c < 0.15:
        return _q_meaning(r)
    if k in ("how", "where"):
        if c < 0.85:
            return ("where" if k == "how" else "how",) + m[1:]
        return (k, dom, other(r, m[2], n(dom + ".v")), m[3]) if c < 0.93 else (k, dom, m[2], other(r, m[3], no))
    if k == "why":
        return (k, dom, m[2], m[3], not m[4]) if c < 0.85 else (k, dom, other(r, m[2], n("forum.fault")), m[3], m[4])
    if c < 0.8:  # cmp: the same words in the other order (or with "less" for "more" alone) ask the opposite;
        return (k, dom, m[3], m[2], m[4]) if k == "cmp" else ("cmp",) + m[1:]  # which: "is A more P than B"
    return k, dom, m[2], m[3], other(r, m[4], n("forum.a"))


def _duplicates(r):
    m, y = _q_meaning(r), int(r.random() < 0.45)
    f = m
    while not y and f == m:
        f = _q_other(r, m)
    return _q_words(r, m), _q_words(r, f), y


# ----------------------------------------------------------------------------- inference (MNLI) and entailment (RTE)


def _le(x, y):
    """A modifier slot x at least as specific as y: the same word, or anything under none (y None)."""
    return y is None or x == y


def nli_label(p, h):
    """0 entailment, 1 neutral, 2 contradiction for two travel facts of one person, verb and object: the object's
    adjective and the town are upward monotone in a positive sentence, downward under negation."""
    if (p["s"], p["v"], p["o"]) != (h["s"], h["v"], h["o"]):
        return 1
    le = lambda x, y: _le(x["adj"], y["adj"]) and _le(x["loc"], y["loc"])
    if p["neg"] == h["neg"]:
        return 0 if (le(h, p) if p["neg"] else le(p, h)) else 1
    return 2 if (le(h, p) if p["neg"] else le(p, h)) else 1  # contradiction: the positive one implies the other


def _travel_words(r, x):
    v = pick(r, "travel.v", x["v"])
    vp = r.choice((["did", "not", v, "any"], ["never", v + "ed", "any"])) if x["neg"] else [v + "ed", "some"]
    loc = ["in", pick(r, "travel.town", x["loc"])] if x["loc"] is not None else []
    return (
        ["the", pick(r, "travel.who", x["s"])]
        + vp
        + [pick(r, "travel.a", x["adj"])] * (x["adj"] is not None)
        + [pick(r, "travel.n", x["o"]) + "s"]
        + loc
        + ["."]
    )


def _slot(r, x, size):
    """Keep a modifier slot, drop it, add one, or change it."""
    c = r.random()
    return x if c < 0.45 else None if x is not None and c < 0.75 else other(r, x, size)


def _inference(r):
    y, c = r.randrange(3), r.random
    p = dict(
        s=r.randrange(n("travel.who")),
        v=r.randrange(n("travel.v")),
        o=r.randrange(n("travel.n")),
        neg=c() < 0.5,
        adj=r.randrange(n("travel.a")) if c() < 0.5 else None,
        loc=r.randrange(n("travel.town")) if c() < 0.5 else None,
    )
    for _ in range(200):
        h = dict(
            p,
            neg=p["neg"] ^ (c() < 0.5),
            adj=_slot(r, p["adj"], n("travel.a")),
            loc=_slot(r, p["loc"], n("travel.town")),
        )
        k = c()
        if k < 0.12:  # another person, verb or object: nothing follows
            slot = r.choice(("s", "v", "o"))
            h[slot] = other(r, p[slot], n({"s": "travel.who", "v": "travel.v", "o": "travel.n"}[slot]))
        if nli_label(p, h) == y:
            return _travel_words(r, p), _travel_words(r, h), y
    return _inference(r)  # a fresh premise when this one does not reach the label


def _rte(r):
    """A two-fact premise and a one-fact hypothesis; facts are (person, verb, object, negated)."""
    y, hist = int(r.random() < 0.5), r.random() < 0.6
    who, vr, obj = ("hist.who", "hist.v", "hist.n") if hist else ("travel.who", "travel.v", "travel.n")
    (p1, p2), (v1, v2), (o1, o2) = (r.sample(range(n(x)), 2) for x in (who, vr, obj))
    form, n1 = r.randrange(5), r.random() < 0.5
    n1 = n1 and form != 3  # "after" states a fact
    n2 = n1 ^ (r.random() < 0.3) if form != 4 else not n1  # mostly the same polarity: "but B did" the other
    facts = [(p1, v1, o1, n1), (p2, v1, o1, n2) if form == 4 else (p2 if form in (1, 3) else p1, v2, o2, n2)]
    P, V, O = (lambda i: ["the", pick(r, who, i)]), (lambda i: pick(r, vr, i)), (lambda i: ["the", pick(r, obj, i)])
    A = lambda v, ng: ["did", "not", V(v)] if ng else [V(v) + "ed"]  # an active verb phrase
    place = ["in", pick(r, "hist.place" if hist else "travel.town")] * (r.random() < 0.3)
    w = {
        0: lambda: P(p1) + [",", "who"] + A(v1, n1) + O(o1) + [","] + A(v2, n2) + O(o2) + place,
        1: lambda: P(p1) + A(v1, n1) + O(o1) + ["and"] + P(p2) + A(v2, n2) + O(o2),
        2: lambda: (
            O(o1)
            + ["was"]
            + ["not"] * n1
            + [V(v1) + "ed", "by"]
            + P(p1)
            + [",", "who"]
            + (["also"] * (not n1) + A(v2, n2))
            + O(o2)
            + place
        ),
        3: lambda: ["after"] + P(p1) + A(v1, n1) + O(o1) + [","] + P(p2) + A(v2, n2) + O(o2) + place,
        4: lambda: P(p1) + A(v1, n1) + O(o1) + [",", "but"] + P(p2) + ["did"] + ["not"] * n2,
    }[form]() + ["."]
    for _ in range(100):  # entailed: the hypothesis is one of the premise's facts (in either voice)
        f, c = r.choice(facts), r.random
        pn = f[0] if c() < 0.93 else r.choice((p1, p2, other(r, p1, n(who), (p2,))))
        vn, on = f[1] if c() < 0.93 else r.choice((v1, v2)), f[2] if c() < 0.93 else r.choice((o1, o2))
        ng = f[3] ^ (c() < 0.5)
        if y == ((pn, vn, on, ng) in facts):
            if c() < 0.6:
                return w, P(pn) + A(vn, ng) + O(on) + ["."], y
            return w, O(on) + ["was"] + ["not"] * ng + [V(vn) + "ed", "by"] + P(pn) + ["."], y
    return _rte(r)


# ----------------------------------------------------------------------------- answerable (QNLI)

_RELS = {"live": 12, "eat": 16, "hunt": 30, "migrate": 6, "has": 50, "color": 8, "found": 10}  # argument counts


def _sci_vp(r, rel, a):
    """A fact's verb phrase; hunt's argument is the hunted entity, has's is 10 * (number - 2) + part."""
    V = lambda i: pick(r, "sci.v", i)
    return {
        "live": lambda: [V(0) + "s", "in", "the", pick(r, "sci.hab", a)],
        "eat": lambda: [V(1) + "s", pick(r, "sci.food", a) + "s"],
        "hunt": lambda: [V(2) + "s", "the", pick(r, "sci.n", a)],
        "migrate": lambda: [V(3) + "s", "in", pick(r, "sci.season", a)],
        "has": lambda: ["has", ("two", "three", "four", "five", "six")[a // 10], pick(r, "sci.part", a % 10) + "s"],
        "color": lambda: ["is", pick(r, "sci.color", a)],
        "found": lambda: ["was", V(4) + "ed", "by", pick(r, "sci.who", a)],
    }[rel]()


def _answerable(r):
    """Facts (relation, entity, argument); a question (relation, entity, hunter or hunted / part) is answered by a
    fact of its relation about its entity."""
    y, s, c = int(r.random() < 0.5), r.randrange(n("sci.n")), r.random()
    fact = lambda e, rel: (rel, e, other(r, e, n("sci.n")) if rel == "hunt" else r.randrange(_RELS[rel]))
    facts = [fact(s, r.choice(tuple(_RELS)))]
    facts += [fact(s if c < 0.6 else other(r, s, n("sci.n")), r.choice(tuple(_RELS)))] * (c < 0.7)
    if len(facts) == 2 and facts[0][:2] == facts[1][:2]:
        facts.pop()  # one relation is stated once per entity
    ents = sorted({f[1] for f in facts} | {f[2] for f in facts if f[0] == "hunt"})
    for _ in range(100):  # a question near the sentence's facts, kept when its answerability is y
        f = r.choice(facts)
        rel = f[0] if r.random() < 0.5 else r.choice(tuple(_RELS))
        e = f[1] if r.random() < 0.8 else r.choice(ents) if r.random() < 0.7 else r.randrange(n("sci.n"))
        e = f[2] if f[0] == rel == "hunt" and r.random() < 0.5 else e  # the hunted: "what hunts it" answers
        x = f[2] % 10 if f[0] == "has" and r.random() < 0.6 else r.randrange(10)  # the part a has-question asks
        x = r.choice(("agent", "patient")) if rel == "hunt" else x
        if y == any(
            g[0] == rel
            and (g[2] if (rel, x) == ("hunt", "patient") else g[1]) == e
            and (rel != "has" or g[2] % 10 == x)
            for g in facts
        ):
            break
    else:
        return _answerable(r)
    E, V = (lambda i: ["the", pick(r, "sci.n", i)]), (lambda i: pick(r, "sci.v", i))
    q = {
        "live": lambda: ["where", "does"] + E(e) + [V(0)],
        "eat": lambda: ["what", "does"] + E(e) + [V(1)],
        "hunt": lambda: ["what", "does"] + E(e) + [V(2)] if x == "agent" else ["what", V(2) + "s"] + E(e),
        "migrate": lambda: ["when", "does"] + E(e) + [V(3)],
        "color": lambda: ["what", "color", "is"] + E(e),
        "has": lambda: ["how", "many", pick(r, "sci.part", x) + "s", "does"] + E(e) + ["have"],
        "found": lambda: ["who", V(4) + "ed"] + E(e),
    }[rel]() + ["?"]
    (r1, e1, a1), (r2, e2, a2) = facts[0], facts[-1]
    if len(facts) == 1:
        return q, E(e1) + _sci_vp(r, r1, a1) + ["."], y
    if e1 != e2:
        link = r.choice((["and"], [",", "but"], [",", "while"]))
        return q, E(e1) + _sci_vp(r, r1, a1) + link + E(e2) + _sci_vp(r, r2, a2) + ["."], y
    first = _sci_vp(r, r1, a1) + ["and"] if r.random() < 0.5 else [",", "which"] + _sci_vp(r, r1, a1) + [","]
    return q, E(e1) + first + _sci_vp(r, r2, a2) + ["."], y


GENERATORS = {
    "acceptability": _acceptability,
    "sentiment": _sentiment,
    "paraphrase": _paraphrase,
    "similarity": _similarity,
    "duplicates": _duplicates,
    "inference": _inference,
    "answerable": _answerable,
    "entailment": _rte,
}
