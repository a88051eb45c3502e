"""Offline assets: a tiny random Gemma 4, a BPE tokenizer and a dolly-format dataset.

    python -m tpufinetune_trainer.assets --out DIR|gs://bucket/prefix [--size tiny|100m]

writes ``DIR/model`` (``from_pretrained``-loadable model + tokenizer) and
``DIR/data/train.jsonl`` (to a bucket: written locally, then uploaded). Nothing is downloaded. The dataset is generated from a seeded
random world (invented countries and people, real animals and produce) so a tiny model
can learn its templates and facts within a few CPU epochs; lengths follow the shape of
databricks-dolly-15k (many short answers, a long tail of stories and long contexts).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Gemma's special-token ids: pad 0, eos 1, bos 2 (the model config hard-codes these),
# then the turn markers of the chat template.
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# A Gemma-style chat template, so the offline tokenizer is an instruct model's: training
# defaults to the chat format with it, as it does with gemma-4-E2B-it.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# Text sizes. `vocab` is the tokenizer's target; the model's vocabulary is the tokenizer's
# real size (tiny) or this many rows (100m, so the embedding counts toward 100M params).
SIZES = {
    "tiny": dict(
        vocab=2048,
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, global_head_dim=32, hidden_size_per_layer_input=16,
                  layer_types=["sliding_attention", "full_attention"] * 2),
    ),
    "100m": dict(
        vocab=8192,
        text=dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                  num_key_value_heads=4, head_dim=64, global_head_dim=64, hidden_size_per_layer_input=64),
    ),
}
# Tiny vision and audio towers, so loading exercises the tutorial's text-only path
# (vision_config=None, audio_config=None drops them) like the real checkpoint does.
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=16, position_embedding_size=64)
TINY_AUDIO = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                  subsampling_conv_channels=[8, 4], output_proj_dims=32)

# --------------------------------------------------------------------------- dataset

_SYLLABLES = ["ka", "lo", "ri", "ven", "tar", "mo", "sel", "dun", "bri", "va", "nor", "el",
              "sha", "qu", "zen", "pa", "gor", "li", "mar", "tho", "as", "fen", "ul", "dra"]
_PROFESSIONS = ["painter", "engineer", "poet", "astronomer", "composer", "architect", "chemist",
                "explorer", "novelist", "mathematician", "sculptor", "physician"]
_WORKS = ["a series of river landscapes", "the first stone bridge over the delta",
          "a book of short poems", "a catalogue of southern stars", "three symphonies",
          "the great library", "a new way to make glass", "a map of the northern coast",
          "a long novel about a fishing town", "a proof about prime numbers",
          "a bronze statue of a horse", "a hospital for sailors"]
ANIMALS = {"dog": (4, "houses and farms", "meat and grain"), "cat": (4, "houses", "meat"),
           "horse": (4, "open fields", "grass and hay"), "chicken": (2, "farms", "seeds and insects"),
           "spider": (8, "corners and gardens", "insects"), "ant": (6, "underground nests", "seeds and sugar"),
           "duck": (2, "ponds and rivers", "plants and small fish"), "cow": (4, "pastures", "grass"),
           "crab": (10, "beaches", "algae and small animals"), "owl": (2, "forests", "mice"),
           "goat": (4, "hills", "leaves and grass"), "bee": (6, "hives", "nectar")}
FRUITS = ["apple", "banana", "cherry", "mango", "pear", "plum", "grape", "peach", "orange", "lemon"]
VEGETABLES = ["carrot", "potato", "onion", "spinach", "cabbage", "pea", "leek", "radish", "celery", "beet"]
LISTS = {"colors": ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink",
                    "brown", "gray", "gold"],
         "sports": ["football", "tennis", "swimming", "running", "cycling", "rowing", "boxing",
                    "skiing", "golf", "hockey", "sailing", "climbing"],
         "tools": ["hammer", "saw", "drill", "wrench", "chisel", "ruler", "shovel", "rake",
                   "ladder", "pliers", "axe", "file"],
         "instruments": ["piano", "violin", "flute", "drum", "guitar", "harp", "trumpet", "cello",
                         "oboe", "horn", "lute", "organ"]}


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


@dataclass
class Country:
    name: str
    capital: str
    river: str
    mountain: str
    language: str
    population: int


@dataclass
class Person:
    name: str
    profession: str
    country: Country
    born: int
    died: int
    work: str


class World:
    def __init__(self, rng: random.Random, countries: int = 30, people: int = 60):
        self.countries = [Country(_name(rng, 2) + "ia", _name(rng, 2), _name(rng, 2), "Mount " + _name(rng, 2),
                                  _name(rng, 2) + "ish", rng.randint(1, 90)) for _ in range(countries)]
        self.people = []
        for _ in range(people):
            born = rng.randint(1500, 1950)
            index = rng.randrange(len(_PROFESSIONS))
            self.people.append(Person(f"{_name(rng, 2)} {_name(rng, 3)}", _PROFESSIONS[index],
                                      rng.choice(self.countries), born, born + rng.randint(30, 90),
                                      _WORKS[index]))


def _country_facts(c: Country) -> list[str]:
    return [f"{c.name} is a country whose capital is {c.capital}.",
            f"The {c.river} river flows through {c.name} and reaches the sea near {c.capital}.",
            f"The highest point of {c.name} is {c.mountain}.",
            f"People in {c.name} speak {c.language}.",
            f"About {c.population} million people live in {c.name}."]


def _person_facts(p: Person) -> list[str]:
    return [f"{p.name} was a {p.profession} from {p.country.name}.",
            f"{p.name} was born in {p.born} in {p.country.capital}.",
            f"{p.name} is best known for {p.work}.",
            f"{p.name} died in {p.died}."]


def _open_qa(rng, w):
    c, p = rng.choice(w.countries), rng.choice(w.people)
    return rng.choice([
        (f"What is the capital of {c.name}?", f"The capital of {c.name} is {c.capital}."),
        (f"Which river flows through {c.name}?", _country_facts(c)[1]),
        (f"What language do people speak in {c.name}?", f"People in {c.name} speak {c.language}."),
        (f"Who was {p.name}?", " ".join(_person_facts(p))),
        (f"Tell me about {c.name}.", " ".join(_country_facts(c))),
    ])


def _general_qa(rng, w):
    animal = rng.choice(sorted(ANIMALS))
    legs, home, food = ANIMALS[animal]
    return rng.choice([
        (f"How many legs does a {animal} have?", f"A {animal} has {legs} legs."),
        (f"Where does a {animal} live and what does it eat?",
         f"A {animal} usually lives in {home}. It eats {food}. A {animal} has {legs} legs."),
        (f"Explain why a {animal} is different from a fish.",
         f"A fish lives in water and swims with fins. A {animal} has {legs} legs and lives in {home}. "
         f"A fish breathes with gills, while a {animal} eats {food} and moves on its legs."),
    ])


def _classification(rng, w):
    if rng.random() < 0.6:
        items = rng.sample(FRUITS + VEGETABLES, rng.randint(3, 8))
        answer = "\n".join(f"{i}: {'fruit' if i in FRUITS else 'vegetable'}" for i in items)
        return f"Classify each of the following as a fruit or a vegetable: {', '.join(items)}", answer
    numbers = rng.sample(range(1, 100), rng.randint(4, 9))
    even = [str(n) for n in numbers if n % 2 == 0] or ["none of them"]
    return f"Which of these numbers are even: {', '.join(map(str, numbers))}?", ", ".join(even)


def _closed_qa(rng, w):
    c = rng.choice(w.countries)
    facts = _country_facts(c)
    filler = [s for other in rng.sample(w.countries, rng.randint(0, 4)) for s in _country_facts(other)[:2]]
    context = " ".join(facts + filler)
    question, answer = rng.choice([
        (f"Based on the text, what is the highest point of {c.name}?", f"The highest point of {c.name} is {c.mountain}."),
        (f"According to this passage, how many people live in {c.name}?",
         f"About {c.population} million people live in {c.name}."),
        (f"From the passage, which river flows through {c.name}?", f"The {c.river} river."),
    ])
    return question, answer, context


def _information_extraction(rng, w):
    people = rng.sample(w.people, rng.randint(1, 4))
    context = " ".join(s for p in people for s in _person_facts(p))
    if rng.random() < 0.5:
        years = [str(y) for p in people for y in (p.born, p.died)]
        return "Extract all the years mentioned in this text as a comma separated list.", ", ".join(years), context
    answer = "\n".join(f"- {p.name}: {p.profession}" for p in people)
    return "List every person in the text with their profession, one per line.", answer, context


def _summarization(rng, w):
    c = rng.choice(w.countries)
    people = [p for p in w.people if p.country is c][:3] or rng.sample(w.people, 1)
    sentences = _country_facts(c) + [s for p in people for s in _person_facts(p)]
    sentences += [s for other in rng.sample(w.countries, rng.randint(0, 6)) for s in _country_facts(other)]
    summary = (f"{c.name} is a country of about {c.population} million people with its capital at "
               f"{c.capital}, crossed by the {c.river} river.")
    return f"Summarize the following passage about {c.name} in one sentence.", summary, " ".join(sentences)


def _brainstorming(rng, w):
    topic = rng.choice(sorted(LISTS))
    k = rng.randint(3, 12)
    return f"Give me a list of {k} {topic}.", "\n".join(f"- {x}" for x in LISTS[topic][:k])


def _creative_writing(rng, w):
    animal, p = rng.choice(sorted(ANIMALS)), rng.choice(w.people)
    legs, home, food = ANIMALS[animal]
    c = p.country
    paragraphs = [f"Once upon a time, a small {animal} lived in {c.capital}, the capital of {c.name}. "
                  f"Like every {animal}, it had {legs} legs and loved {food}."]
    episodes = [f"One morning the {animal} walked to the banks of the {c.river} river and watched the boats.",
                f"At noon the {animal} climbed toward {c.mountain}, where the air was cold and clear.",
                f"In the evening the {animal} met {p.name}, a {p.profession}, who was working on {p.work}.",
                f"The {animal} listened to people speaking {c.language} in the market and learned a few words.",
                f"When winter came, the {animal} went back to {home} and ate {food} by the fire."]
    paragraphs += episodes[: rng.randint(1, len(episodes))] * rng.randint(1, 6)
    paragraphs.append(f"And so the {animal} of {c.capital} lived happily, and {p.name} wrote about it for years.")
    return f"Write a short story about a {animal} who lives in {c.capital}.", "\n\n".join(paragraphs)


# Dolly's category mix (databricks-dolly-15k, rounded).
CATEGORIES = [("open_qa", 0.25, _open_qa), ("general_qa", 0.15, _general_qa),
              ("classification", 0.14, _classification), ("closed_qa", 0.12, _closed_qa),
              ("brainstorming", 0.12, _brainstorming), ("information_extraction", 0.10, _information_extraction),
              ("summarization", 0.08, _summarization), ("creative_writing", 0.04, _creative_writing)]


def generate_dataset(n: int = 1500, seed: int = 1234) -> list[dict]:
    """`n` dolly-format rows; the same (n, seed) always gives the same rows."""
    rng = random.Random(seed)
    world = World(random.Random(seed + 1))
    names = [c[0] for c in CATEGORIES]
    weights = [c[1] for c in CATEGORIES]
    makers = {c[0]: c[2] for c in CATEGORIES}
    rows = []
    for _ in range(n):
        category = rng.choices(names, weights)[0]
        made = makers[category](rng, world)
        instruction, response = made[0], made[1]
        context = made[2] if len(made) > 2 else ""
        rows.append({"instruction": instruction, "context": context, "response": response, "category": category})
    return rows


# --------------------------------------------------------------------------- model + tokenizer


def build_tokenizer(texts: list[str], vocab_size: int, extra_special: list[str] | None = None):
    """A byte-level BPE trained on `texts`, wrapped so AutoTokenizer can reload it.
    `extra_special`: more special tokens (vision_assets: Gemma 4's media tokens), each of
    MEDIA_TOKENS' names also an attribute of the tokenizer (`image_token`, `image_token_id`)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special or []),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    named = {}
    if extra_special:
        from .vision_assets import MEDIA_TOKENS

        named = {"extra_special_tokens": {name: token for name, token in MEDIA_TOKENS.items() if token in extra_special}}
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                      bos_token="<bos>", unk_token="<unk>",
                                      additional_special_tokens=SPECIAL_TOKENS[4:], **named)
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_model(size: str, vocab_size: int, seed: int = 0):
    """A randomly initialised Gemma 4 (text + tiny towers). Small `vocab_size_per_layer_input`
    and `global_head_dim`: their defaults (262144, 512) alone would make it huge."""
    import torch
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = dict(SIZES[size]["text"], vocab_size=vocab_size, vocab_size_per_layer_input=vocab_size,
                max_position_embeddings=4096, sliding_window=256, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    config = Gemma4Config(text_config=text, vision_config=TINY_VISION, audio_config=TINY_AUDIO)
    torch.manual_seed(seed)
    return Gemma4ForConditionalGeneration(config)


def prompt_texts(rows: list[dict]) -> list[str]:
    return [" ".join(r[k] for k in ("instruction", "context", "response")) for r in rows]


def write_assets(out: Path, size: str = "tiny", rows: int = 1500, seed: int = 1234) -> dict:
    out = Path(out)
    data_dir, model_dir = out / "data", out / "model"
    data_dir.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    dataset = generate_dataset(rows, seed)
    with open(data_dir / "train.jsonl", "w", encoding="utf-8") as f:
        for row in dataset:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    # The prompt scaffolding is part of what the tokenizer must know well.
    tokenizer = build_tokenizer(prompt_texts(dataset) + ["Instruction: Context: Response: user model"] * 50,
                                SIZES[size]["vocab"])
    vocab = len(tokenizer) if size == "tiny" else max(len(tokenizer), SIZES[size]["vocab"])
    model = build_model(size, vocab, seed)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    params = sum(p.numel() for p in model.parameters())
    return {"model": str(model_dir), "data": str(data_dir / "train.jsonl"), "rows": len(dataset),
            "vocab": vocab, "parameters": params}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory or gs:// prefix to write model/ and data/ into")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--rows", type=int, default=1500, help="dataset rows")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--kind", choices=["text", "vision"], default="text",
                        help="text: the dolly-format task; vision: the tiny multimodal model and its image task "
                             "(vision_assets.py; --size and --rows do not apply)")
    args = parser.parse_args(argv)
    from . import storage

    def write(where: Path) -> dict:
        if args.kind == "vision":
            from .vision_assets import write_vision_assets

            return write_vision_assets(where, seed=args.seed)
        return write_assets(where, args.size, args.rows, args.seed)

    if not storage.is_uri(args.out):
        info = write(Path(args.out))
    else:
        with tempfile.TemporaryDirectory(prefix="tpuft-assets-") as local:
            info = write(Path(local))
            storage.upload_dir(local, args.out)
        base = args.out.rstrip("/")
        info.update(model=f"{base}/model", data=f"{base}/data/train.jsonl")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
