"""A fixed NIAH filler: English prose generated from a committed grammar, the same bytes everywhere.

The ``corpus`` haystack is the running Python's ``pydoc_data`` topics, which change with the
interpreter's build (two machines' prompts differed by 156 tokens at 32K). ``prose`` is generated
here by integer arithmetic only (a 64-bit linear congruential generator over the word lists below;
no ``random``, no hashing of Python objects), so every Python, platform and version produces the
same text, checked against :data:`PROSE_SHA256` (the test suite and ``niah_gpu.py`` refuse a
different text). It has no digits, so the needle's 7-digit number is the only number in a prompt.
"""

from __future__ import annotations

import hashlib

PROSE_SENTENCES = 6000       # about 95K tokens of filler: every NIAH length up to 32K draws distinct sentences
PROSE_SHA256 = "317bda06d9f808cc3e801a81e11f350d6f044f6332985510d091b4442d4c78cf"

_ADJ = ("old", "quiet", "narrow", "distant", "bright", "heavy", "gentle", "early", "late", "broad", "pale", "warm",
        "cold", "busy", "empty", "silent", "steady", "sudden", "patient", "careful", "simple", "modest", "hidden",
        "open", "green", "grey", "northern", "southern", "wooden", "stone", "small", "large")
_NOUN = ("harbor", "village", "river", "garden", "market", "library", "bridge", "valley", "orchard", "workshop",
         "lantern", "ledger", "road", "meadow", "tower", "school", "kitchen", "forest", "mill", "station", "island",
         "chapel", "field", "courtyard", "archive", "lighthouse", "farm", "canal", "square", "museum")
_PERSON = ("the keeper", "the teacher", "a traveller", "the miller", "an old sailor", "the baker", "a young clerk",
           "the gardener", "the mayor", "a carpenter", "the librarian", "a fisherman", "the weaver", "a shepherd")
_VERB_PAST = ("remembered", "described", "repaired", "visited", "painted", "measured", "crossed", "guarded",
              "studied", "cleaned", "mapped", "admired", "rebuilt", "sketched", "watched", "counted")
_VERB = ("wait", "listen", "rest", "gather", "wander", "return", "settle", "linger", "change", "grow")
_ADV = ("slowly", "quietly", "carefully", "patiently", "gladly", "rarely", "often", "openly", "gently", "briefly")
_TIME = ("In the spring", "Every autumn", "Long ago", "On winter evenings", "At first light", "Later that year",
         "Before the harvest", "After the long rains", "During the fair", "Some mornings")
_TOPIC = ("the weather", "the tides", "the old roads", "the price of bread", "the color of the sky",
          "the habits of birds", "the shape of the hills", "the sound of the bells", "the history of the town",
          "the names of the streets")

_TEMPLATES = (
    "{time}, {person} {verb_past} the {adj} {noun} near the {noun2}.",
    "Nobody at the {noun} expected {person} to {verb} so {adv}.",
    "The {adj} {noun} stood beside the {adj2} {noun2}, and {person} {verb_past} it {adv}.",
    "Stories about {topic} were told {adv} in the {adj} {noun}.",
    "{time}, the people of the {noun} would {verb} by the {noun2} and talk about {topic}.",
    "{person_cap} kept a ledger of {topic}, which the {noun} still holds.",
    "It was said that the {noun} had once been {adj}, before {person} {verb_past} the {noun2}.",
    "From the {adj} {noun} one could see the {noun2} and, on clear days, the {adj2} {noun3}.",
    "{person_cap} {verb_past} {topic} {adv}, and wrote a few lines about it every evening.",
    "The path to the {noun} was {adj} in those years, so visitors would {verb} at the {noun2}.",
    "{time}, the {noun} grew {adj}, and the {noun2} seemed to {verb} with it.",
    "Few remember why the {noun} was built so close to the {adj} {noun2}.",
)


class _Lcg:
    """Knuth's MMIX 64-bit linear congruential generator; ``below(n)`` takes the high bits."""

    def __init__(self, seed: int):
        self.state = seed & 0xFFFFFFFFFFFFFFFF

    def below(self, n: int) -> int:
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) & 0xFFFFFFFFFFFFFFFF
        return (self.state >> 33) * n >> 31


def prose_sentences(count: int = PROSE_SENTENCES, seed: int = 1) -> list[str]:
    """``count`` generated sentences (deterministic for ``count`` and ``seed``)."""
    rng = _Lcg(seed)
    pick = lambda xs: xs[rng.below(len(xs))]  # noqa: E731
    out = []
    for _ in range(count):
        t = pick(_TEMPLATES)
        person = pick(_PERSON)
        out.append(t.format(time=pick(_TIME), person=person, person_cap=person[0].upper() + person[1:],
                            verb_past=pick(_VERB_PAST), verb=pick(_VERB), adv=pick(_ADV), adj=pick(_ADJ),
                            adj2=pick(_ADJ), noun=pick(_NOUN), noun2=pick(_NOUN), noun3=pick(_NOUN),
                            topic=pick(_TOPIC)))
    return out


def prose_text() -> str:
    """The ``prose`` haystack: :func:`prose_sentences` joined by spaces."""
    return " ".join(prose_sentences())


def prose_sha256() -> str:
    return hashlib.sha256(prose_text().encode("utf-8")).hexdigest()
