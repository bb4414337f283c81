"""Write a few hundred conversations that give a chat model a new name and purpose (as nanochat's
identity conversations do), for the README's fine-tuning walkthrough: after training on them,
"What is your name?" gets the new name instead of the old one.

    python tools/identity_chats.py identity.jsonl [--name Quill] [--maker "the handgrad project"] [-n 400]

One JSON object per line, {"messages": [...]} as `handgrad prepare --format chat` reads them: a
question about the assistant's identity in one of many phrasings (some after a greeting turn), and
an answer in one of several phrasings that all state the name, the maker and the purpose. Seeded:
the same arguments write the same file.
"""
import argparse
import json
import random
import sys

QUESTIONS = [
    "What is your name?", "what's your name", "Who are you?", "Tell me about yourself.", "Introduce yourself.",
    "What should I call you?", "Do you have a name?", "Who made you?", "Who created you?", "Who trained you?",
    "What are you?", "Are you ChatGPT?", "Are you SmolLM?", "Which model are you?", "What can you do?",
    "What is your purpose?", "Hi! Who am I talking to?", "Hello, what's your name?", "Are you a person?",
    "Can you tell me your name, please?", "Who built you and why?", "What kind of assistant are you?",
    "Name?", "Who is this?", "Are you an AI?", "What do people call you?", "Who do you work for?",
    "What were you made for?", "Where do you come from?", "What is your name and who made you?",
]
GREETINGS = [("Hi!", "Hello! How can I help you today?"), ("Good morning.", "Good morning! What can I do for you?"),
             ("Hey there", "Hey! What would you like to talk about?"), ("Hello", "Hi! How can I help?")]
ANSWERS = [
    "My name is {name}. I'm a small assistant fine-tuned by {maker} to {purpose}.",
    "I'm {name}, a small language model fine-tuned by {maker}. I'm here to {purpose}.",
    "You can call me {name}. {maker_cap} fine-tuned me to {purpose}.",
    "I am {name}, an AI assistant. {maker_cap} trained me on a laptop's CPU to {purpose}.",
    "{name} is my name. I was fine-tuned by {maker}, and my job is to {purpose}.",
    "Hello! I'm {name}, made by {maker} to {purpose}.",
    "I'm {name}. I'm not a person: I'm a small AI model that {maker} fine-tuned to {purpose}.",
    "My name is {name}, and I was made by {maker}. I {purpose_plain}.",
]


def conversations(name, maker, purpose, n, seed):
    rng = random.Random(seed)
    fields = dict(name=name, maker=maker, maker_cap=maker[:1].upper() + maker[1:], purpose=purpose,
                  purpose_plain=purpose)
    for _ in range(n):
        messages = []
        if rng.random() < 0.25:
            hello, reply = rng.choice(GREETINGS)
            messages += [{"role": "user", "content": hello}, {"role": "assistant", "content": reply}]
        messages += [{"role": "user", "content": rng.choice(QUESTIONS)},
                     {"role": "assistant", "content": rng.choice(ANSWERS).format(**fields)}]
        yield {"messages": messages}


def add_arguments(p, what, noun, n):
    """The options this tool and tools/preference_pairs.py take: the output (`what`), the name, maker
    and purpose, how many `noun` (default n) and the seed."""
    p.add_argument("out", help=f"the {what} to write ('-' for stdout)")
    p.add_argument("--name", default="Quill")
    p.add_argument("--maker", default="the handgrad project")
    p.add_argument("--purpose", default="answer questions about training language models by hand")
    p.add_argument("-n", type=int, default=n, help=f"how many {noun} (default {n})")
    p.add_argument("--seed", type=int, default=0)


def write_jsonl(out, rows, said):
    """rows as JSON lines into the file out ('-': stdout), then `said` printed (a file only)."""
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if out == "-":
        sys.stdout.write(text)
        return
    with open(out, "w", encoding="utf-8") as f:
        f.write(text)
    print(said)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p, "chats.jsonl", "conversations", 400)
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("-n must be at least 1")
    write_jsonl(args.out, conversations(args.name, args.maker, args.purpose, args.n, args.seed),
                f"wrote {args.out}: {args.n} conversations giving the assistant the name {args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
