"""Train kvlib's default model: a small Llama that writes readable English, with no download.

The text is documentation that ships with CPython itself, so it is on every machine that runs
this script and free to redistribute (Python Software Foundation License, version 2):

- ``pydoc_data.topics``: the language reference topics behind ``help()``;
- the docstrings of a fixed list of pure-Python standard-library modules.

The script trains a byte-level BPE tokenizer and a Llama-family decoder with transformers, then
writes a Hugging Face folder (config.json, model.safetensors, tokenizer.json) that kvlib loads
through the same loader as any checkpoint. Run from the repository root:

    python tools/train_default_model.py --out kvlib/assets/default-model

It is deterministic for a given Python version, torch version and thread count.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import math
import time
from pathlib import Path

import torch

STDLIB_MODULES = [
    "abc", "argparse", "ast", "asyncio", "base64", "bisect", "calendar", "cmd", "codecs", "collections",
    "configparser", "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "email",
    "enum", "fileinput", "fnmatch", "fractions", "ftplib", "functools", "getopt", "gettext", "glob",
    "gzip", "hashlib", "heapq", "hmac", "html", "http.client", "http.server", "imaplib", "inspect", "io",
    "ipaddress", "json", "logging", "mailbox", "mimetypes", "numbers", "operator", "optparse", "os",
    "pathlib", "pickle", "pprint", "queue", "random", "re", "secrets", "selectors", "shelve", "shlex",
    "shutil", "smtplib", "socket", "socketserver", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "types", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "wave", "xml.dom.minidom", "zipfile",
]
SPECIAL_TOKENS = ["<s>", "</s>", "<unk>"]


def corpus() -> list[str]:
    """Documents: one per help() topic and one per documented object of the listed modules."""
    from pydoc_data.topics import topics
    docs = [topics[key] for key in sorted(topics)]
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        objects = [module] + [obj for _, obj in sorted(vars(module).items())
                              if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == name]
        for obj in objects:
            doc = inspect.getdoc(obj)
            if doc and len(doc) > 80:
                docs.append(doc)
    return docs


def train_tokenizer(docs: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    tokenizer.save(str(out / "tokenizer.json"))
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("kvlib/assets/default-model"))
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    import transformers

    torch.manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    docs = corpus()
    tokenizer = train_tokenizer(docs, args.vocab_size, args.out)
    eos = tokenizer.token_to_id("</s>")
    ids = []
    for doc in docs:
        ids.extend(tokenizer.encode(doc).ids + [eos])
    data = torch.tensor(ids)
    print(f"{len(docs)} documents, {sum(map(len, docs)):,} characters, {len(data):,} tokens")
    heads = args.hidden // 32
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3 // 32 * 32,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 3),
        head_dim=32, max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.token_to_id("<s>"), eos_token_id=eos, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config)
    print(f"{sum(p.numel() for p in model.parameters()):,} parameters")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = 100
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup)
                                                 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    generator = torch.Generator().manual_seed(args.seed)
    start = time.time()
    for step in range(args.steps):
        offsets = torch.randint(0, len(data) - args.context - 1, (args.batch,), generator=generator)
        batch = torch.stack([data[o:o + args.context + 1] for o in offsets])
        loss = model(input_ids=batch, labels=batch).loss  # transformers shifts the labels by one
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  {time.time() - start:.0f}s", flush=True)
    model.save_pretrained(args.out, safe_serialization=True)
    config_path = args.out / "config.json"
    config_json = json.loads(config_path.read_text())
    config_json.pop("transformers_version", None)
    config_path.write_text(json.dumps(config_json, indent=2, sort_keys=True))
    (args.out / "generation_config.json").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
