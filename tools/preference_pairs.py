"""Write a few hundred preference pairs for DPO after tools/identity_chats.py's SFT: they keep the
new name and take back the side effect of that SFT, a model that introduces itself whatever it is
asked (docs/FINETUNE.md shows both).

    python tools/preference_pairs.py prefs.jsonl [--name Quill] [--maker "the handgrad project"] [-n 300]

Two kinds of pair, half each (--general sets the share of the second):
* asked about itself, in identity_chats.py's phrasings: the chosen reply is one of its answers with
  the new name and maker, the rejected one the same words with another name and maker (the ones
  small instruct models give: SmolLM2-135M-Instruct's Elena, SmolLM and Hugging Face, ChatGPT and
  OpenAI), so the preference is about exactly those tokens;
* asked a plain question (QUESTIONS below: capitals, sums, everyday facts): the chosen reply answers
  it, the rejected one is the self-introduction.

One JSON object per line in TRL's conversational preference layout, as `handgrad prepare --format
preference` reads it: {"prompt": [messages], "chosen": [the reply], "rejected": [the other reply]}.
Seeded: the same arguments write the same file.
"""
import argparse
import random
import sys

from identity_chats import ANSWERS, GREETINGS, QUESTIONS as ABOUT_YOU, add_arguments, write_jsonl

OTHERS = [("Elena", "a team of AI researchers"), ("SmolLM", "Hugging Face"), ("ChatGPT", "OpenAI"),
          ("Assistant", "an AI company"), ("SmolLM2", "the Hugging Face team")]  # (name, maker) of the rejected
QUESTIONS = [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("What is 2 + 2?", "2 + 2 = 4."),
    ("How many days are in a week?", "A week has seven days."),
    ("What color is the sky on a clear day?", "On a clear day the sky is blue."),
    ("What is the largest planet in the solar system?", "Jupiter is the largest planet in the solar system."),
    ("What do bees make?", "Bees make honey."),
    ("How many legs does a spider have?", "A spider has eight legs."),
    ("At what temperature does water boil?", "At sea level, water boils at 100 degrees Celsius."),
    ("Who wrote Romeo and Juliet?", "William Shakespeare wrote Romeo and Juliet."),
    ("What is the capital of Japan?", "The capital of Japan is Tokyo."),
    ("What is the opposite of hot?", "The opposite of hot is cold."),
    ("How many continents are there?", "There are seven continents."),
    ("What gas do plants take in from the air?", "Plants take in carbon dioxide from the air."),
    ("What is 10 times 3?", "10 times 3 is 30."),
    ("At what temperature does water freeze?", "Water freezes at 0 degrees Celsius."),
    ("What is the capital of Italy?", "The capital of Italy is Rome."),
    ("How many hours are in a day?", "A day has 24 hours."),
    ("What is the chemical formula of water?", "The chemical formula of water is H2O."),
    ("What is the first letter of the English alphabet?", "The first letter of the English alphabet is A."),
    ("Name a primary color.", "Red is a primary color."),
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("How many sides does a triangle have?", "A triangle has three sides."),
    ("Which planet do we live on?", "We live on Earth."),
    ("What is the tallest animal?", "The giraffe is the tallest animal."),
    ("What is the capital of Germany?", "The capital of Germany is Berlin."),
    ("What is 5 minus 3?", "5 minus 3 is 2."),
    ("Which ocean is the largest?", "The Pacific Ocean is the largest ocean."),
    ("What language is spoken in Brazil?", "Portuguese is spoken in Brazil."),
    ("How many months are in a year?", "A year has twelve months."),
    ("What is the sun?", "The sun is the star at the center of our solar system."),
    ("Give me a word that means happy.", "Joyful means happy."),
    ("What is the capital of England?", "The capital of England is London."),
    ("What is ice?", "Ice is frozen water."),
    ("How many wheels does a bicycle have?", "A bicycle has two wheels."),
]


def pairs(name, maker, purpose, n, general, seed):
    rng = random.Random(seed)

    def answer(template, name, maker):
        return template.format(name=name, maker=maker, maker_cap=maker[:1].upper() + maker[1:], purpose=purpose,
                               purpose_plain=purpose)
    for _ in range(n):
        prompt = []
        if rng.random() < 0.25:
            hello, reply = rng.choice(GREETINGS)
            prompt += [{"role": "user", "content": hello}, {"role": "assistant", "content": reply}]
        template = rng.choice(ANSWERS)
        if rng.random() < general:
            question, chosen = rng.choice(QUESTIONS)
            rejected = answer(template, name, maker)
        else:
            question = rng.choice(ABOUT_YOU)
            chosen, rejected = answer(template, name, maker), answer(template, *rng.choice(OTHERS))
        yield {"prompt": prompt + [{"role": "user", "content": question}],
               "chosen": [{"role": "assistant", "content": chosen}],
               "rejected": [{"role": "assistant", "content": rejected}]}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, "JSONL", "pairs", 300)
    p.add_argument("--general", type=float, default=0.5,
                   help="the share of pairs about plain questions rather than the assistant itself (default 0.5)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("-n must be at least 1")
    if not 0 <= args.general <= 1:
        p.error("--general must be in [0, 1]")
    write_jsonl(args.out, pairs(args.name, args.maker, args.purpose, args.n, args.general, args.seed),
                f"wrote {args.out}: {args.n} preference pairs keeping the name {args.name} and answering plain "
                f"questions plainly")
    return 0


if __name__ == "__main__":
    sys.exit(main())
