"""data.py — question sets: the embedded "toy world" and loaders for the formats users have.

Search-R1 trains on NQ + HotpotQA and evaluates on seven QA sets over a 21M-passage Wikipedia
dump. None of that fits an offline CPU demo, so this file also builds a synthetic stand-in:

* **Toy world** (`toy_world(seed)`): invented, pronounceable people, cities, countries and
  companies with facts (birthplace, birth year, employer, founding year, founder, HQ city,
  country, capital, independence year). Every entity gets one or two passages of natural
  sentences in wiki-18 format (`{"id", "contents": "\"Title\"\ntext"}`), with distractors:
  near-identical names (Orlan/Orlen), shared surnames, companies sharing a root or named after
  another city, and other cities and years mentioned in the same passage. Questions come in
  three `data_source`s mirroring the paper's training mix: `toy_nq` (single hop: one BM25
  search with the question's words finds the passage), `toy_hotpot_bridge` (two hops: the
  second entity is only named in the first passage) and `toy_hotpot_comparison` ("Who was
  born first, A or B?"). Train and test are split by *country*: a country's cities, the people
  born there and the companies based there all land in the same split, so test questions are
  about entities that no training question mentions. The names are invented, so a model that
  does not search can only guess; `python data.py --check` measures that, and checks that an
  oracle reading the gold passages (`support` ids in each record) answers every question.
  Simplified: facts are few and templated; real Wikipedia questions are far more varied.

* **Loaders** (`load_questions`): FlashRAG JSONL, Search-R1 parquet (needs pyarrow), our own
  JSONL, or a `<root>/<dataset>/<split>.jsonl` folder. All give the same Record:
  `{"id", "question", "golds", "data_source"}` (+ optional keys such as `support`).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

Record = dict  # {"id": str, "question": str, "golds": list[str], "data_source": str, ...optional}

TOY_VERSION = 2  # bump when generation changes, so cached worlds are rebuilt
TOY_SIZES = {
    "countries": 40, "cities_per_country": 6, "companies": 500, "people": 2000,
    "test_countries": 8,  # 20% of the world, with everything located in it, is test-only
    "questions": {
        "train": {"toy_nq": 2000, "toy_hotpot_bridge": 1200, "toy_hotpot_comparison": 800},
        "test": {"toy_nq": 300, "toy_hotpot_bridge": 180, "toy_hotpot_comparison": 120},
    },
}

# ----------------------------------------------------------------------------------------------
# Templates. A template's relation slots ({birth_city}, {founded}, ...) carry the facts that
# questions ask about; any other slot is noise. The oracle reader turns the same templates into
# regular expressions, so "the passage says it" is checked by construction, not assumed.
# ----------------------------------------------------------------------------------------------

YEAR_RELATIONS = {"birth_year", "founded", "independence"}
NAME_RELATIONS = {"birth_city", "employer", "founder", "hq", "country", "capital"}

PERSON_BIRTH = [
    "{name} was born in {birth_city} in {birth_year}.",
    "{name} (born {birth_year}) is a {job} from {birth_city}.",
    "{name} is a {job} who was born in {birth_city} in {birth_year}.",
    "Born in {birth_city} in {birth_year}, {name} grew up {childhood}.",
]
PERSON_EMPLOYER = [
    "{subj} works for {employer}.",
    "{subj} has worked at {employer} since {year2}.",
    "{subj} is currently employed by {employer}.",
]
COMPANY_FOUNDING = [
    "{name} is a {industry} company founded in {founded} by {founder}.",
    "{name} was founded by {founder} in {founded}.",
    "Founded in {founded} by {founder}, {name} is a {industry} business.",
]
COMPANY_HQ = [
    "Its headquarters are in {hq}.",
    "The company is headquartered in {hq}.",
    "{subj} is based in {hq}.",
]
CITY_COUNTRY = [
    "{name} is a city in {country}.",
    "{name} is a town in the {direction} of {country}.",
    "The city of {name} lies in {country}.",
]
COUNTRY_CAPITAL = [
    "{name} is a country whose capital is {capital}.",
    "The capital of {name} is {capital}.",
]
COUNTRY_INDEPENDENCE = [
    "{subj} became independent in {independence}.",
    "{subj} declared independence in {independence}.",
]
RELATION_TEMPLATES = (PERSON_BIRTH + PERSON_EMPLOYER + COMPANY_FOUNDING + COMPANY_HQ
                      + CITY_COUNTRY + COUNTRY_CAPITAL + COUNTRY_INDEPENDENCE)

PERSON_NOISE = [
    "{subj} now lives in {residence}.",
    "{subj} studied {subject} at the University of {uni_city}.",
    "{subj} enjoys {hobby} in {pos} free time.",
    "{Pos} {relative} {sibling} is a {job2}.",
]
FOUNDER_CAREER = [
    "{name} founded {own_company} in {own_founded}. Before that, {pron} worked at {prev_company}.",
    "In {own_founded}, {name} started {own_company} after {n_years} years at {prev_company}.",
]
COMPANY_NOISE = [
    "It employs about {n_staff} people.",
    "It opened an office in {other_city} in {year2}.",
    "It should not be confused with {similar}.",
]
CITY_NOISE = [
    "It has about {population} inhabitants.",
    "It is twinned with {twin}.",
    "The {river} river flows through the city.",
]
COUNTRY_NOISE = ["It borders {neighbor}.", "Its official language is {language}."]

JOBS = ["painter", "engineer", "teacher", "chemist", "architect", "novelist", "pilot", "surgeon",
        "economist", "sculptor", "composer", "lawyer", "journalist", "botanist", "chef"]
SUBJECTS = ["physics", "history", "law", "music", "medicine", "economics", "geology", "poetry"]
HOBBIES = ["sailing", "chess", "gardening", "climbing", "fishing", "cycling", "pottery"]
CHILDHOODS = ["by the sea", "on a farm", "in a large family", "near the old harbour"]
INDUSTRIES = ["Freight", "Mining", "Labs", "Textiles", "Bank", "Motors", "Foods", "Software",
              "Energy", "Airlines", "Shipping", "Pharma", "Media", "Steel", "Insurance"]
DIRECTIONS = ["north", "south", "east", "west"]

# (data_source, subject type, relation chain, comparison, question templates). A chain is
# followed from the subject entity: ("founder", "birth_city") = birthplace of the founder.
QUESTION_KINDS = [
    ("toy_nq", "person", ("birth_city",), None,
     ["Where was {a} born?", "In which city was {a} born?", "What is the birthplace of {a}?"]),
    ("toy_nq", "person", ("birth_year",), None, ["In what year was {a} born?", "When was {a} born?"]),
    ("toy_nq", "person", ("employer",), None, ["Which company does {a} work for?", "Who employs {a}?"]),
    ("toy_nq", "company", ("founded",), None, ["In what year was {a} founded?", "When was {a} founded?"]),
    ("toy_nq", "company", ("hq",), None, ["In which city is {a} headquartered?", "Where is {a} based?"]),
    ("toy_nq", "company", ("founder",), None, ["Who founded {a}?", "Who is the founder of {a}?"]),
    ("toy_nq", "city", ("country",), None, ["In which country is {a}?", "{a} is a city in which country?"]),
    ("toy_nq", "country", ("capital",), None, ["What is the capital of {a}?"]),
    ("toy_nq", "country", ("independence",), None, ["In what year did {a} become independent?"]),
    ("toy_hotpot_bridge", "company", ("founder", "birth_city"), None,
     ["In which city was the founder of {a} born?", "Where was the founder of {a} born?"]),
    ("toy_hotpot_bridge", "company", ("founder", "birth_year"), None,
     ["In what year was the founder of {a} born?"]),
    ("toy_hotpot_bridge", "company", ("hq", "country"), None,
     ["In which country is {a} headquartered?", "In which country is the headquarters of {a}?"]),
    ("toy_hotpot_bridge", "person", ("birth_city", "country"), None, ["In which country was {a} born?"]),
    ("toy_hotpot_bridge", "person", ("employer", "founded"), None,
     ["In what year was the company that {a} works for founded?", "When was the employer of {a} founded?"]),
    ("toy_hotpot_bridge", "person", ("employer", "founder"), None,
     ["Who founded the company that {a} works for?"]),
    ("toy_hotpot_bridge", "person", ("employer", "hq"), None,
     ["In which city is the company that {a} works for headquartered?"]),
    ("toy_hotpot_comparison", "person", ("birth_year",), "min",
     ["Who was born first, {a} or {b}?", "Who is older, {a} or {b}?"]),
    ("toy_hotpot_comparison", "person", ("birth_year",), "max",
     ["Who was born later, {a} or {b}?", "Who is younger, {a} or {b}?"]),
    ("toy_hotpot_comparison", "company", ("founded",), "min",
     ["Which company was founded first, {a} or {b}?", "Which is older, {a} or {b}?"]),
    ("toy_hotpot_comparison", "company", ("founded",), "max",
     ["Which company was founded more recently, {a} or {b}?"]),
]

NAME_RE = r"[A-Z][a-z]+(?: [A-Z][a-z]+)*"  # names are capitalised words, nothing else is


# ----------------------------------------------------------------------------------------------
# Toy world generation
# ----------------------------------------------------------------------------------------------

class _Namer:
    """Invented pronounceable words; each word is used once in the world unless reused on purpose."""

    ONSETS = "b d f g k l m n p r s t v z br dr gr kr tr th st sk vr sh".split()
    VOWELS = "a e i o u a e o".split()
    CODAS = ["", "", "", "n", "r", "l", "s", "m"]

    def __init__(self, rng: random.Random):
        self.rng, self.used = rng, set()

    def take(self, word: str) -> bool:
        if word.lower() in self.used or not 4 <= len(word) <= 12:
            return False
        self.used.add(word.lower())
        return True

    def stem(self) -> str:
        r = self.rng
        return (r.choice(self.ONSETS) + r.choice(self.VOWELS) + r.choice(self.CODAS)
                + r.choice(self.ONSETS) + r.choice(self.VOWELS))

    def new(self, suffixes: list[str]) -> str:
        while True:
            word = (self.stem() + self.rng.choice(suffixes)).capitalize()
            if self.take(word):
                return word

    def similar(self, word: str) -> str | None:
        """One vowel changed (Orlan -> Orlen): a distractor that BM25 still tells apart."""
        spots = [i for i, c in enumerate(word) if c in "aeiou"]
        for _ in range(10):
            i = self.rng.choice(spots)
            variant = word[:i] + self.rng.choice([v for v in "aeiou" if v != word[i]]) + word[i + 1:]
            if self.take(variant):
                return variant
        return None


def _build_world(rng: random.Random, sizes: dict) -> dict[str, dict]:
    """Entities by name: {"type", "split", relations as strings, noise attributes}."""
    namer = _Namer(rng)
    world: dict[str, dict] = {}
    countries = [namer.new(["ia", "and", "onia", "aria", "ovia"]) for _ in range(sizes["countries"])]
    test_countries = set(rng.sample(countries, sizes["test_countries"]))
    cities = []
    for country in countries:
        split = "test" if country in test_countries else "train"
        mine = []
        while len(mine) < sizes["cities_per_country"]:
            if cities and rng.random() < 0.2:  # same stem, other suffix: Kelford vs Kelmere
                stem = re.sub(r"(ford|mere|holm|grad|port|dale|ven|ora)$", "", rng.choice(cities))
                name = stem + rng.choice(["ford", "mere", "holm", "grad", "port", "dale", "ven", "ora"])
                if not namer.take(name):
                    continue
            else:
                name = namer.new(["ford", "mere", "holm", "grad", "port", "dale", "ven", "ora"])
            mine.append(name)
            world[name] = {"type": "city", "split": split, "country": country,
                           "population": f"{rng.randint(2, 900) * 1000:,}",
                           "river": namer.new(["", "a", "e"]), "direction": rng.choice(DIRECTIONS)}
        cities += mine
        world[country] = {"type": "country", "split": split, "capital": mine[0],
                          "independence": str(rng.randint(1650, 1990)),
                          "language": namer.new(["ish", "ese", "ic"])}
    for name in cities:
        world[name]["twin"] = rng.choice(cities)
    for country in countries:
        world[country]["neighbor"] = rng.choice([c for c in countries if c != country])

    firsts = [namer.new(["", "a", "n", "el", "in", "is"]) for _ in range(sizes["people"] // 4)]
    firsts += [v for v in (namer.similar(f) for f in firsts[: len(firsts) // 5]) if v]
    surnames = [namer.new(["by", "son", "ard", "ley", "wick", "ell", "ton", "berg"])
                for _ in range(sizes["people"] // 3)]
    people = []
    while len(people) < sizes["people"]:
        name = f"{rng.choice(firsts)} {rng.choice(surnames)}"
        if name in world:
            continue
        city = rng.choice(cities)
        people.append(name)
        world[name] = {"type": "person", "split": world[city]["split"], "birth_city": city,
                       "birth_year": str(rng.randint(1925, 2000)), "female": rng.random() < 0.5,
                       "job": rng.choice(JOBS), "residence": rng.choice([c for c in cities if c != city]),
                       "uni_city": rng.choice(cities)}
    family = collections.defaultdict(list)
    for p in people:
        family[p.split()[1]].append(p)

    roots: list[str] = []
    companies = []
    while len(companies) < sizes["companies"]:
        hq = rng.choice(cities)
        u = rng.random()
        if roots and u < 0.2:  # shared root: Kelvora Freight vs Kelvora Mining
            root = rng.choice(roots)
        elif u < 0.35:  # named after another city: "Velmora Freight" is not in Velmora
            root = rng.choice([c for c in cities if c != hq])
        else:
            root = namer.new(["ex", "ion", "ium", "o", "a", "ar"])
            roots.append(root)
        name = f"{root} {rng.choice(INDUSTRIES)}"
        if name in world:
            continue
        companies.append(name)
        world[name] = {"type": "company", "split": world[hq]["split"], "hq": hq,
                       "industry": name.split()[-1].lower(), "n_staff": f"{rng.randint(1, 400) * 50:,}",
                       "other_city": rng.choice([c for c in cities if c != hq])}

    # Founders: one company each, old enough to have founded it; they work at their company.
    for split in ("train", "test"):
        free = [p for p in people if world[p]["split"] == split and int(world[p]["birth_year"]) <= 1985]
        rng.shuffle(free)
        mine = [c for c in companies if world[c]["split"] == split]
        if len(free) < len(mine):
            raise ValueError(f"toy sizes: {split} has more companies than possible founders")
        for company, founder in zip(mine, free):
            c, f = world[company], world[founder]
            c["founder"] = founder
            c["founded"] = str(min(2022, int(f["birth_year"]) + rng.randint(22, 55)))
            f["own_company"] = f["employer"] = company
            f["own_founded"] = c["founded"]
        for p in people:
            if world[p]["split"] == split and "employer" not in world[p]:
                world[p]["employer"] = rng.choice(mine)
    for name in companies:
        twins = [c for c in companies if c != name and c.split()[0] == name.split()[0]]
        world[name]["similar"] = twins[0] if twins else None
    for p in people:
        kin = [q for q in family[p.split()[1]] if q != p]
        world[p]["sibling"] = rng.choice(kin) if kin else None
    return world


def _fill(template: str, entity: dict, name: str, first: bool, rng: random.Random, extra: dict) -> str:
    female = entity.get("female", False)
    pron = "it" if entity["type"] in ("company", "country", "city") else ("she" if female else "he")
    subj = name if first or rng.random() < 0.3 else pron.capitalize()
    values = {**entity, **extra, "name": name, "subj": subj, "pron": pron,
              "pos": "her" if female else "his", "Pos": "Her" if female else "His"}
    return template.format(**values)


def _passages(name: str, e: dict, world: dict, rng: random.Random) -> list[tuple[str, list[str]]]:
    """One or two passages for an entity: (text, relations stated in it)."""
    pick = rng.choice
    extra = {"job2": pick(JOBS), "subject": pick(SUBJECTS), "hobby": pick(HOBBIES),
             "childhood": pick(CHILDHOODS), "relative": pick(["sister", "brother", "cousin"]),
             "n_years": rng.randint(2, 15)}
    if "employer" in e:  # distractor years stay plausible: joined after birth and founding
        extra["year2"] = rng.randint(max(int(e["birth_year"]) + 20, int(world[e["employer"]]["founded"])), 2024)
    elif "founded" in e:
        extra["year2"] = rng.randint(int(e["founded"]), 2024)
    if e["type"] == "person":
        noise = [t for t in PERSON_NOISE if e["sibling"] or "{sibling}" not in t]
        bio = [pick(PERSON_BIRTH), pick(noise)]
        if "own_company" in e:
            second = [pick(FOUNDER_CAREER), pick(PERSON_EMPLOYER)]
        elif rng.random() < 0.25:
            second = [pick(PERSON_EMPLOYER), pick(noise)]
        else:
            bio.insert(1, pick(PERSON_EMPLOYER))
            second = []
        groups = [(bio, ["birth_city", "birth_year"] + ([] if second else ["employer"]))]
        if second:
            groups.append((second, ["employer"]))
    elif e["type"] == "company":
        noise = [t for t in COMPANY_NOISE if e["similar"] or "{similar}" not in t]
        groups = [([pick(COMPANY_FOUNDING), pick(COMPANY_HQ), pick(noise)], ["founded", "founder", "hq"])]
    elif e["type"] == "city":
        groups = [([pick(CITY_COUNTRY), pick(CITY_NOISE)], ["country"])]
    else:
        groups = [([pick(COUNTRY_CAPITAL), pick(COUNTRY_INDEPENDENCE), pick(COUNTRY_NOISE)],
                   ["capital", "independence"])]
    return [(" ".join(_fill(t, e, name, i == 0, rng, extra) for i, t in enumerate(ts)), rels)
            for ts, rels in groups]


def _follow(facts: dict, entity: str, chain: tuple) -> str | None:
    for relation in chain:
        entity = facts.get(entity, {}).get(relation)
        if entity is None:
            return None
    return entity


def _golds(world: dict, value: str) -> list[str]:
    """Aliases: a person is also right by surname alone; years are digits already."""
    if world.get(value, {}).get("type") == "person":
        return [value, value.split()[-1]]
    return [value]


def _norm(text: str) -> str:
    # Toy answers are capitalised words and digits, so this equals SQuAD normalisation on them.
    return " ".join(re.sub(r"[^a-z0-9 ]", " ", text.lower()).split())


def _questions(world: dict, split: str, wanted: dict, fact_pid: dict, rng: random.Random) -> list[Record]:
    by_type = collections.defaultdict(list)
    for name, e in world.items():
        if e["split"] == split:
            by_type[e["type"]].append(name)
    records = []
    for source, n_wanted in wanted.items():
        kinds = [k for k in QUESTION_KINDS if k[0] == source]
        pool = []
        for _, etype, chain, op, templates in kinds:
            if op is None:
                for a in by_type[etype]:
                    if _follow(world, a, chain) is not None:
                        pool.append((chain, op, templates, a, None))
            else:
                for _ in range(4 * n_wanted // len(kinds)):
                    a, b = rng.sample(by_type[etype], 2)
                    if (_follow(world, a, chain) != _follow(world, b, chain)
                            and a.split()[-1] != b.split()[-1]):
                        pool.append((chain, op, templates, a, b))
        rng.shuffle(pool)
        chosen, seen = [], set()
        for chain, op, templates, a, b in pool:
            if len(chosen) == n_wanted:
                break
            question = rng.choice(templates).format(a=a, b=b)
            if op is None:
                answer = _follow(world, a, chain)
                support, entity = [], a
                for relation in chain:
                    support.append(fact_pid[entity, relation])
                    entity = world[entity][relation]
            else:
                years = {x: int(_follow(world, x, chain)) for x in (a, b)}
                answer = (min if op == "min" else max)((a, b), key=years.get)
                support = [fact_pid[a, chain[0]], fact_pid[b, chain[0]]]
            golds = _golds(world, answer)
            # An answer readable off the question (a founder who shares the employee's surname)
            # would reward guessing; comparison answers are in the question by design (50%).
            leaked = op is None and any(f" {_norm(g)} " in f" {_norm(question)} " for g in golds)
            if leaked or question in seen:
                continue
            seen.add(question)
            chosen.append({"id": "", "question": question, "golds": golds, "data_source": source,
                           "support": support})
        records += chosen
    rng.shuffle(records)
    for i, r in enumerate(records):
        r["id"] = f"toy-{split}-{i}"
    return records


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=True) + "\n")


def build_toy_world(seed: int, out_dir: Path, sizes: dict | None = None) -> dict:
    """Generate the toy world into out_dir (corpus.jsonl, train.jsonl, test.jsonl, meta.json)."""
    sizes = sizes or TOY_SIZES
    rng = random.Random(seed)
    world = _build_world(rng, sizes)
    people = [n for n, e in world.items() if e["type"] == "person"]
    for p in people:  # a founder's earlier job is a distractor company of the same split
        if "own_company" in world[p]:
            same = [c for c, e in world.items() if e["type"] == "company" and e["split"] == world[p]["split"]
                    and c != world[p]["own_company"]]
            world[p]["prev_company"] = rng.choice(same)
    corpus, fact_pid = [], {}
    for name, e in world.items():
        for text, relations in _passages(name, e, world, rng):
            pid = str(len(corpus))
            corpus.append({"id": pid, "contents": f'"{name}"\n{text}'})
            for relation in relations:
                fact_pid[name, relation] = pid
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out_dir / "corpus.jsonl", corpus)
    meta = {"version": TOY_VERSION, "seed": seed, "passages": len(corpus), "entities": {}, "questions": {}}
    for e in world.values():
        counts = meta["entities"].setdefault(e["type"], {"train": 0, "test": 0})
        counts[e["split"]] += 1
    for split, wanted in sizes["questions"].items():
        records = _questions(world, split, wanted, fact_pid, rng)
        _write_jsonl(out_dir / f"{split}.jsonl", records)
        counts = collections.Counter(r["data_source"] for r in records)
        meta["questions"][split] = {source: counts[source] for source in wanted}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def cache_dir() -> Path:
    return Path(os.environ.get("LLDS_CACHE", "~/.cache/llds")).expanduser()


def toy_world(seed: int = 0) -> Path:
    """Directory holding the toy world for this seed; generated on first use (~1 s)."""
    target = cache_dir() / "toy_world" / f"v{TOY_VERSION}-seed{seed}"
    if (target / "meta.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".building-"))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary folder
    build_toy_world(seed, tmp)
    try:  # atomic: another process may be building the same world at the same time
        os.rename(tmp, target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# ----------------------------------------------------------------------------------------------
# Oracle reader: answers from the gold passages only, by the templates that wrote them
# ----------------------------------------------------------------------------------------------

def _template_regex(template: str) -> re.Pattern:
    """Relation slots become named groups; the subject ({name} or {subj}) becomes group "who"."""
    out = []
    for part in re.split(r"(\{\w+\})", template):
        slot = part[1:-1] if part.startswith("{") else None
        if slot is None:
            out.append(re.escape(part))
        elif slot in ("name", "subj"):
            out.append(f"(?P<who>{NAME_RE})")
        elif slot in YEAR_RELATIONS:
            out.append(rf"(?P<{slot}>\d{{4}})")
        elif slot in NAME_RELATIONS:
            out.append(rf"(?P<{slot}>{NAME_RE})")
        else:
            out.append(r"[^.]+?")
    return re.compile("".join(out))


def read_facts(passages: list[str]) -> dict[str, dict[str, str]]:
    """Facts stated in wiki-18 passages ("\"Title\"\ntext"), by title, as written by the templates.
    A sentence counts when its subject is the title or a pronoun (every passage is about its title)."""
    facts: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for contents in passages:
        title, _, text = contents.partition("\n")
        title = title.strip('"')
        for regex in _RELATION_REGEXES:
            for m in regex.finditer(text):
                if m.groupdict().get("who") in (None, title, "He", "She", "It"):
                    facts[title].update({k: v for k, v in m.groupdict().items() if k != "who"})
    return facts


def _question_regexes() -> list[tuple[re.Pattern, tuple, str | None]]:
    out = []
    for _, _, chain, op, templates in QUESTION_KINDS:
        for t in templates:
            pattern = re.escape(t)
            for slot in "ab":
                pattern = pattern.replace(rf"\{{{slot}\}}", f"(?P<{slot}>{NAME_RE})")
            out.append((re.compile(pattern), chain, op))
    return out


_RELATION_REGEXES = [_template_regex(t) for t in RELATION_TEMPLATES]
_QUESTION_REGEXES = _question_regexes()


def oracle_answer(question: str, passages: list[str]) -> str | None:
    """Answer a toy question from its support passages: the question's template names the
    relation chain, the passages' templates give the facts. None when something is missing."""
    facts = read_facts(passages)
    for pattern, chain, op in _QUESTION_REGEXES:
        m = pattern.fullmatch(question)
        if not m:
            continue
        if op is None:
            return _follow(facts, m["a"], chain)
        years = {x: _follow(facts, x, chain) for x in (m["a"], m["b"])}
        if None in years.values():
            return None
        return (min if op == "min" else max)((m["a"], m["b"]), key=lambda x: int(years[x]))
    return None


# ----------------------------------------------------------------------------------------------
# Checks: the oracle answers everything; question-only guessing stays at chance
# ----------------------------------------------------------------------------------------------

def _em(prediction: str | None, golds: list[str]) -> float:
    return float(prediction is not None and _norm(prediction) in {_norm(g) for g in golds})


def _by_source(records: list[Record], scores: list[float]) -> dict[str, float]:
    groups = collections.defaultdict(list)
    for r, s in zip(records, scores):
        groups[r["data_source"]].append(s)
        groups["all"].append(s)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def check_oracle(world_dir: Path, split: str) -> dict[str, float]:
    """EM of the oracle reader given each question's support passages (should be 1.0)."""
    corpus = {d["id"]: d["contents"] for _, d in _read_jsonl(Path(world_dir) / "corpus.jsonl")}
    records = load_questions(str(Path(world_dir) / f"{split}.jsonl"))
    scores = [_em(oracle_answer(r["question"], [corpus[i] for i in r["support"]]), r["golds"])
              for r in records]
    return _by_source(records, scores)


def check_priors(world_dir: Path) -> dict[str, dict[str, float]]:
    """Test EM of answers chosen without reading anything:
    train_prior - the most frequent train answer per data_source;
    best_fixed  - the most frequent *test* answer per question template (an optimistic bound for
                  any guess that ignores the entity names);
    first_mentioned  - comparison questions: always the first-mentioned entity (chance = 0.5)."""
    train = load_questions(str(Path(world_dir) / "train.jsonl"))
    test = load_questions(str(Path(world_dir) / "test.jsonl"))
    prior = {}
    for source in sorted({r["data_source"] for r in train}):
        answers = collections.Counter(r["golds"][0] for r in train if r["data_source"] == source)
        prior[source] = answers.most_common(1)[0][0]
    template = {}
    for pattern, _, _ in _QUESTION_REGEXES:
        template[pattern.pattern] = collections.Counter(r["golds"][0] for r in test
                                                        if pattern.fullmatch(r["question"]))
    best_fixed = []
    for r in test:
        counter = next(c for p, c in template.items() if re.fullmatch(p, r["question"]))
        best_fixed.append(_em(counter.most_common(1)[0][0], r["golds"]))
    comparison = [r for r in test if r["data_source"] == "toy_hotpot_comparison"]
    first = [_em(re.search(f"({NAME_RE}) or", r["question"])[1], r["golds"]) for r in comparison]
    return {"train_prior": _by_source(test, [_em(prior.get(r["data_source"]), r["golds"]) for r in test]),
            "best_fixed": _by_source(test, best_fixed),
            "first_mentioned": _by_source(comparison, first)}


def check_bm25(world_dir: Path, split: str, topk: int = 3) -> dict[str, dict[str, float]] | None:
    """Share of questions whose raw text retrieves (a) the first-hop support passage and (b) all
    support passages in BM25 top-k. None when retriever.py is not available."""
    try:
        from retriever import open_retriever
    except ImportError:
        return None
    world_dir = Path(world_dir)
    retriever = open_retriever("bm25", corpus=str(world_dir / "corpus.jsonl"), index=str(world_dir / "bm25"))
    records = load_questions(str(world_dir / f"{split}.jsonl"))
    hits = retriever.search([r["question"] for r in records], topk)
    found = [{h["document"]["id"] for h in hs} for hs in hits]
    return {"first_hop": _by_source(records, [float(r["support"][0] in f) for r, f in zip(records, found)]),
            "all_hops": _by_source(records, [float(set(r["support"]) <= f) for r, f in zip(records, found)])}


# ----------------------------------------------------------------------------------------------
# Loaders
# ----------------------------------------------------------------------------------------------

def _read_jsonl(path: Path):
    """Yields (line number, parsed object); errors name the file and line."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {n}: not valid JSON ({e.msg})") from None


def _as_golds(value) -> list | None:
    if hasattr(value, "tolist"):  # numpy arrays, as pandas hands back list columns
        value = value.tolist()
    if isinstance(value, (str, int, float)):
        return [str(value)]
    if isinstance(value, (list, tuple)):
        return [str(v) if isinstance(v, (int, float)) else v for v in value]
    return None


def _record(raw, where: str, default_source: str, default_id: str) -> Record:
    """Validate one FlashRAG / own-format record into a Record; errors say where it came from."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: missing or empty 'question'")
    golds = _as_golds(raw["golds"] if "golds" in raw else raw.get("golden_answers"))
    if not golds or not all(isinstance(g, str) and g.strip() for g in golds):
        raise ValueError(f"{where}: needs a non-empty list of answer strings in 'golds' or 'golden_answers'")
    source = raw.get("data_source") or default_source
    record = {k: v for k, v in raw.items() if k != "golden_answers"}
    record.update(id=str(raw["id"]) if raw.get("id") is not None else default_id.format(source=source),
                  question=question.strip(), golds=golds, data_source=str(source))
    return record


def _load_jsonl(path: Path, limit: int | None, default_source: str) -> list[Record]:
    records = []
    for n, raw in _read_jsonl(path):
        if limit is not None and len(records) >= limit:
            break
        records.append(_record(raw, f"{path}: line {n}", default_source, "{source}:%d" % len(records)))
    return records


def question_from_prompt(prompt) -> str:
    """The question inside a Search-R1 prompt: the last user message, after "Question: "."""
    if isinstance(prompt, str):
        text = prompt
    else:
        messages = list(prompt) if prompt is not None else []  # a list, or a numpy array via pandas
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        text = users[-1] if users else ""
    return text.rsplit("Question:", 1)[-1].strip()


def searchr1_record(row: dict, where: str, default_source: str, row_index: int) -> Record:
    """One Search-R1 parquet row ({data_source, prompt, reward_model, extra_info}) as a Record."""
    source = row.get("data_source") or default_source
    target = ((row.get("reward_model") or {}).get("ground_truth") or {}).get("target")
    index = (row.get("extra_info") or {}).get("index", row_index)
    # Search-R1's merged files number rows per source, hence data_source:index as the id.
    raw = {"id": f"{source}:{index}", "question": question_from_prompt(row.get("prompt")),
           "golds": _as_golds(target), "data_source": source}
    return _record(raw, where, default_source, "")


def _load_parquet(path: Path, limit: int | None, default_source: str) -> list[Record]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    rows = pq.read_table(path).to_pylist()[:limit]
    return [searchr1_record(row, f"{path}: row {n}", default_source, n - 1) for n, row in enumerate(rows, 1)]


def _load_file(path: Path, limit: int | None, default_source: str) -> list[Record]:
    if path.suffix == ".parquet":
        return _load_parquet(path, limit, default_source)
    if path.suffix == ".jsonl":
        return _load_jsonl(path, limit, default_source)
    raise ValueError(f"{path}: unknown question file type (expected .jsonl or .parquet)")


def _split_file(folder: Path, split: str) -> Path | None:
    for name in [split] + (["dev"] if split == "test" else []):  # FlashRAG has no test for some sets
        for ext in (".jsonl", ".parquet"):
            if (folder / f"{name}{ext}").exists():
                return folder / f"{name}{ext}"
    return None


TOY_SOURCES = ("toy_nq", "toy_hotpot_bridge", "toy_hotpot_comparison")


def is_toy(source: str) -> bool:
    """"toy" (the whole toy world) or one of its question kinds, e.g. "toy_nq" (single-hop only)."""
    return source == "toy" or source in TOY_SOURCES


def load_questions(source: str, limit: int | None = None, split: str = "train") -> list[Record]:
    """Records from "toy" or one toy kind such as "toy_nq" (its `split`), a FlashRAG/own .jsonl,
    a Search-R1 .parquet, a dataset folder holding <split>.jsonl (test falls back to dev), or a root of such folders (all
    datasets, `limit` each). data_source defaults to the dataset folder or file name."""
    if is_toy(source):
        if split not in ("train", "test"):
            raise ValueError(f"the toy world has splits 'train' and 'test', not {split!r}")
        records = _load_jsonl(toy_world() / f"{split}.jsonl", None, "toy")
        return [r for r in records if source in ("toy", r["data_source"])][:limit]
    path = Path(source).expanduser()
    if path.is_file():
        return _load_file(path, limit, path.stem)
    if path.is_dir():
        own = _split_file(path, split)
        if own:
            return _load_file(own, limit, path.name)
        datasets = [d for d in sorted(path.iterdir()) if d.is_dir() and _split_file(d, split)]
        if datasets:
            return [r for d in datasets for r in _load_file(_split_file(d, split), limit, d.name)]
        raise ValueError(f"{path}: no {split}.jsonl here nor in <dataset>/{split}.jsonl subfolders")
    raise ValueError(f"{source}: no such file or folder (expected 'toy' or {', '.join(TOY_SOURCES)}, "
                     "a .jsonl or .parquet file, or a folder laid out <root>/<dataset>/<split>.jsonl)")


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------

def _fmt(scores: dict[str, float]) -> str:
    return "  ".join(f"{k}={v:.3f}" for k, v in scores.items())


def main() -> None:
    parser = argparse.ArgumentParser(description="Build the toy world and print its statistics, "
                                     "or inspect any question file.")
    parser.add_argument("--seed", type=int, default=0, help="toy world seed")
    parser.add_argument("--check", action="store_true",
                        help="also run the checks: oracle EM, no-search baselines, BM25 top-3 recall")
    parser.add_argument("--show", type=int, default=2, help="example questions to print per data source")
    parser.add_argument("--source",
                        help="instead of the toy world, load this question file/folder and summarise it")
    parser.add_argument("--split", default="test", help="split for --source folders")
    parser.add_argument("--limit", type=int, help="records to load per file with --source")
    args = parser.parse_args()
    try:
        if args.source:
            records = load_questions(args.source, args.limit, args.split)
            print(f"{len(records)} records:", dict(collections.Counter(r["data_source"] for r in records)))
            for r in records[: args.show]:
                print(" ", json.dumps(r)[:300])
            return
        start = time.perf_counter()
        world_dir = cache_dir() / "toy_world" / f"v{TOY_VERSION}-seed{args.seed}"
        built = not (world_dir / "meta.json").exists()
        world_dir = toy_world(args.seed)
        took = time.perf_counter() - start
        print(f"toy world seed {args.seed}: {world_dir} ({'built' if built else 'cached'}, {took:.2f}s)")
        meta = json.loads((world_dir / "meta.json").read_text())
        print(f"passages: {meta['passages']}   entities (train/test): "
              + ", ".join(f"{k} {v['train']}/{v['test']}" for k, v in meta["entities"].items()))
        for split, counts in meta["questions"].items():
            print(f"{split} questions: {sum(counts.values())}  {counts}")
        test = load_questions(str(world_dir / "test.jsonl"))
        for source in meta["questions"]["test"]:
            for r in [r for r in test if r["data_source"] == source][: args.show]:
                print(f"  [{source}] {r['question']} -> {r['golds']}")
        if args.check:
            for split in ("train", "test"):
                print(f"oracle EM from support passages ({split}): {_fmt(check_oracle(world_dir, split))}")
            for name, scores in check_priors(world_dir).items():
                print(f"no-search baseline {name} (test EM): {_fmt(scores)}")
            print("chance for comparison questions: 0.500")
            bm25 = check_bm25(world_dir, "test")
            if bm25 is None:
                print("BM25 top-3 recall: skipped (retriever.py not importable)")
            else:
                for name, scores in bm25.items():
                    print(f"BM25 top-3 with the raw question, {name} support found (test): {_fmt(scores)}")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
