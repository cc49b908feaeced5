"""The generator of the toy world and its checks: invented people, cities, countries and companies,
each stated in one or two wiki-18 passages (`{"id", "contents": "\"Title\"\ntext"}`) written from
templates with near-identical distractors (Orlan/Orlen, shared surnames, companies sharing a root or
named after another city), and single-hop, bridge and comparison questions whose `support` ids name
the gold passages. Train and test are split by country: a country's cities, the people born there and
the companies based there all land in one split. Same seed, same bytes, whatever the hash seed. The
checks read the world back: an oracle that parses the passages with the very templates that wrote
them answers every question from its support passages; guesses that read nothing stay at chance; raw
questions find their first hop with BM25. data.py's `toy_world()` caches the result per seed.
This is the experiment's data, the file to edit for other question kinds, splits or distractors
(bump TOY_VERSION then, so that cached worlds are rebuilt).
"""
from __future__ import annotations

import collections
import json
import random
import re
from pathlib import Path

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


def _questions(world: dict, split: str, wanted: dict, fact_pid: dict, rng: random.Random) -> list[dict]:
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
            leaked = op is None and any(re.search(rf"\b{re.escape(g)}\b", question, re.IGNORECASE)
                                        for g in golds)
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


def write_jsonl(path: Path, rows: list[dict]) -> None:
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
    write_jsonl(out_dir / "corpus.jsonl", corpus)
    meta = {"version": TOY_VERSION, "seed": seed, "passages": len(corpus), "entities": {}, "questions": {}}
    for e in world.values():
        counts = meta["entities"].setdefault(e["type"], {"train": 0, "test": 0})
        counts[e["split"]] += 1
    for split, wanted in sizes["questions"].items():
        records = _questions(world, split, wanted, fact_pid, rng)
        write_jsonl(out_dir / f"{split}.jsonl", records)
        counts = collections.Counter(r["data_source"] for r in records)
        meta["questions"][split] = {source: counts[source] for source in wanted}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return meta

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


def parse_question(question: str) -> tuple[str, str | None, tuple, str | None] | None:
    """(a, b, relation chain, comparison) of a toy question, read by its template; None if no
    template wrote it. b and the comparison are None for single-hop and bridge questions."""
    for pattern, chain, op in _QUESTION_REGEXES:
        m = pattern.fullmatch(question)
        if m:
            return m["a"], m.groupdict().get("b"), chain, op
    return None


def oracle_answer(question: str, passages: list[str]) -> str | None:
    """Answer a toy question from its support passages: the question's template names the
    relation chain, the passages' templates give the facts. None when something is missing."""
    facts, parsed = read_facts(passages), parse_question(question)
    if parsed is None:
        return None
    a, b, chain, op = parsed
    if op is None:
        return _follow(facts, a, chain)
    years = {x: _follow(facts, x, chain) for x in (a, b)}
    if None in years.values():
        return None
    return (min if op == "min" else max)((a, b), key=lambda x: int(years[x]))


# ----------------------------------------------------------------------------------------------
# Checks: the oracle answers everything; question-only guessing stays at chance
# ----------------------------------------------------------------------------------------------

def _read_rows(path: Path) -> list[dict]:
    """Rows of a file that build_toy_world wrote (trusted: user files go through data.py's loaders)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _by_source(records: list[dict], scores: list[float]) -> dict[str, float]:
    groups = collections.defaultdict(list)
    for r, s in zip(records, scores):
        groups[r["data_source"]].append(s)
        groups["all"].append(s)
    return {k: sum(v) / len(v) for k, v in sorted(groups.items())}


def check_oracle(world_dir: Path, split: str) -> dict[str, float]:
    """EM of the oracle reader given each question's support passages (should be 1.0)."""
    from rollout import exact_match  # torch comes with it: only the checks pay for that import

    corpus = {d["id"]: d["contents"] for d in _read_rows(Path(world_dir) / "corpus.jsonl")}
    records = _read_rows(Path(world_dir) / f"{split}.jsonl")
    scores = [exact_match(oracle_answer(r["question"], [corpus[i] for i in r["support"]]), r["golds"])
              for r in records]
    return _by_source(records, scores)


def check_priors(world_dir: Path) -> dict[str, dict[str, float]]:
    """Test EM of answers chosen without reading anything:
    train_prior - the most frequent train answer per data_source;
    best_fixed  - the most frequent *test* answer per question template (an optimistic bound for
                  any guess that ignores the entity names);
    first_mentioned  - comparison questions: always the first-mentioned entity (chance = 0.5)."""
    from rollout import exact_match

    train = _read_rows(Path(world_dir) / "train.jsonl")
    test = _read_rows(Path(world_dir) / "test.jsonl")
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
        best_fixed.append(exact_match(counter.most_common(1)[0][0], r["golds"]))
    comparison = [r for r in test if r["data_source"] == "toy_hotpot_comparison"]
    first = [exact_match(re.search(f"({NAME_RE}) or", r["question"])[1], r["golds"]) for r in comparison]
    return {"train_prior": _by_source(test, [exact_match(prior.get(r["data_source"]), r["golds"]) for r in test]),
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
    records = _read_rows(world_dir / f"{split}.jsonl")
    hits = retriever.search([r["question"] for r in records], topk)
    found = [{h["document"]["id"] for h in hs} for hs in hits]
    return {"first_hop": _by_source(records, [float(r["support"][0] in f) for r, f in zip(records, found)]),
            "all_hops": _by_source(records, [float(set(r["support"]) <= f) for r, f in zip(records, found)])}

