"""The bundled tiny Ouro and its arithmetic task, regenerated bit for bit.

    python examples/tiny/generate.py

writes into the package's bundle, ouro_cli/bundled/tiny/ (shipped in the wheel as package
data, so that an installed `ouro train` finds its defaults):

    model/            HF Ouro directory: config.json, model.safetensors, tokenizer.json,
                      tokenizer_config.json (ChatML template), generation_config.json
    train.jsonl       training prompts   {"prompt", "label", "metadata": {"problem_id"}}
    eval.jsonl        held-out prompts (no problem shared with train.jsonl)
    SHA256SUMS        sha256 of every file above (`sha256sum -c SHA256SUMS` checks them)

and prints the held-out accuracy at K = 1..4 of the model it wrote.

Why it is built this way:

- The task is two-step arithmetic on single digits ("What is 3*4+5?", every value in
  0..20) with a short worked answer, `<think>3*4=12\n12+5=17</think>\boxed{17}<|im_end|>`,
  so that the `\boxed{}` integer reward applies and every response is ~20 tokens: a GRPO
  update on a laptop CPU takes seconds.
- The model is pre-trained teacher-forced on prompt + response, loss on the response only,
  with the prompt at full depth T and the response of each sequence at one depth drawn
  from `DEPTH_MIX`, mostly T — the rollout/replay contract of docs/model.md §3 with a uniform
  decode budget K. The loops therefore matter: K = 4 is clearly better than K = 1.
- Partial reward by design: in `SLIP_RATE` of the pre-training responses (drawn afresh
  each time) one step's result is off by 1 or 2 and the slip is carried to the boxed
  answer. The policy learns the arithmetic (greedy decoding is right far more often) but
  samples slips at temperature 1.0 — the mistakes a reward can remove, so GRPO has room
  to improve it visibly within minutes. Training is also short (`TRAIN_STEPS`), so some
  arithmetic is still unlearned, mostly at small K.
- The pre-trained model is sharp: GRPO moves it at lr ~1e-4 (measured: `ouro train
  --depths 2 3 4 --updates 60 --lr 1e-4` took K = 4 from 0.365 to 0.550 on 200 held-out
  prompts); at 1e-3 and above a fresh Adam's first steps wreck it within a few updates.
- The exit gate keeps its random initialisation (it is never trained here and GRPO
  freezes it); with `early_exit_threshold` 1.0 a token runs exactly K loops.
- Bit for bit: one thread, deterministic algorithms, fixed seeds, data generated with
  `random.Random(seed)`, and every file written with sorted keys. The generator uses the
  project's own model (`ouro_cli.model`) and writer (`ouro_cli.checkpoint.write_hf`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a clone without installing the package

from ouro_cli.bundled import TINY as BUNDLE  # noqa: E402
from ouro_cli.checkpoint import write_hf  # noqa: E402
from ouro_cli.model import OuroForCausalLM, build, tiny_config  # noqa: E402

SEED = 1234
NUM_EVAL = 200
MAX_VALUE = 20  # every intermediate value and answer lies in 0..MAX_VALUE
T = 4  # total_ut_steps
# Response depth of a pre-training sequence -> probability. Mostly full depth, so the
# loops matter, with enough shallow sequences that K = 2, 3 earn some reward too.
DEPTH_MIX = {1: 0.10, 2: 0.15, 3: 0.15, 4: 0.60}
# Share of pre-training responses whose worked answer carries one arithmetic slip (drawn
# afresh each time a problem is drawn), and the slips: the pre-trained policy puts most
# mass on the right result but samples slips — the mistakes GRPO's reward removes.
SLIP_RATE = 0.4
SLIPS = (-2, -1, 1, 2)
TRAIN_STEPS = 1000
BATCH = 64
LR = 5e-3
WARMUP = 50

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK, BOXED = "<think>", "</think>", "\\boxed{"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def render_prompt(prompt: str) -> str:
    """The ChatML rendering of one user turn, as ouro's default template writes it."""
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n"


# ---- tokenizer ------------------------------------------------------------------------

# ids 0..2 as in Ouro; then the markup the task and reward use; then a small word-level
# vocabulary: words whole, digits / whitespace / punctuation one character each.
SPECIAL = [ENDOFTEXT, IM_START, IM_END]
MARKUP = [THINK, END_THINK, BOXED, "<unk>"]
WORDS = [
    "user",
    "assistant",
    "system",
    "What",
    "is",
    "the",
    "answer",
    "Compute",
    "Answer",
    "You",
    "are",
    "a",
    "helpful",
    "and",
    "of",
    "to",
    "think",
    "step",
    "by",
    "so",
]
CHARS = list("0123456789") + list("+-*/=()?.,:;!{}[]<>|\\_'\"#%&^~@$`") + [" ", "\n", "\t"]
PRETOKENIZE = r"[A-Za-z]+|[0-9]|\s|[^A-Za-z0-9\s]"


def build_tokenizer():
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL + MARKUP + WORDS + CHARS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()  # concatenate: whitespace is a token of its own
    tokenizer.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL + ["<unk>"]])
    tokenizer.add_tokens([AddedToken(t, normalized=False, special=False) for t in (THINK, END_THINK, BOXED)])
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": ENDOFTEXT,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": ENDOFTEXT,
        "model_max_length": 512,
        "pad_token": ENDOFTEXT,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


# ---- task -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    a: int
    op1: str
    b: int
    op2: str
    c: int

    @property
    def text(self) -> str:
        return f"{self.a}{self.op1}{self.b}{self.op2}{self.c}"

    def steps(self, slip: tuple[int, int] | None = None) -> list[tuple[int, str, int, int]] | None:
        """(x, op, y, x op y) in evaluation order (* before + and -), or None when a value
        leaves 0..MAX_VALUE. `slip=(step, delta)` writes that step's result off by delta and
        carries the wrong value on, as a person making an arithmetic slip would."""
        where, delta = slip if slip is not None else (-1, 0)
        if self.op2 == "*" and self.op1 != "*":
            v1 = self.b * self.c + (delta if where == 0 else 0)
            first, second = (self.b, "*", self.c, v1), (self.a, self.op1, v1, _apply(self.a, self.op1, v1))
        else:
            v1 = _apply(self.a, self.op1, self.b) + (delta if where == 0 else 0)
            first, second = (self.a, self.op1, self.b, v1), (v1, self.op2, self.c, _apply(v1, self.op2, self.c))
        if where == 1:
            second = (*second[:3], second[3] + delta)
        steps = [first, second]
        return steps if all(0 <= s[3] <= MAX_VALUE for s in steps) else None

    @property
    def answer(self) -> int:
        return self.steps()[-1][3]

    @property
    def prompt(self) -> str:
        return f"What is {self.text}?"

    def response(self, slip: tuple[int, int] | None = None) -> str:
        """The worked answer, with the slip if one is given and it keeps values in range."""
        steps = (self.steps(slip) if slip is not None else None) or self.steps()
        work = "\n".join(f"{x}{op}{y}={v}" for x, op, y, v in steps)
        return f"{THINK}{work}{END_THINK}{BOXED}{steps[-1][3]}}}{IM_END}"


def _apply(x: int, op: str, y: int) -> int:
    return x + y if op == "+" else x - y if op == "-" else x * y


def all_problems() -> list[Problem]:
    problems = [
        Problem(a, op1, b, op2, c)
        for a in range(1, 10)
        for op1 in "+-*"
        for b in range(1, 10)
        for op2 in "+-*"
        for c in range(1, 10)
    ]
    return [p for p in problems if p.steps() is not None]


def split_problems(seed: int) -> tuple[list[Problem], list[Problem]]:
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    return problems[NUM_EVAL:], problems[:NUM_EVAL]


def jsonl_rows(problems: list[Problem], split: str) -> list[dict]:
    return [
        {"prompt": p.prompt, "label": p.answer, "metadata": {"problem_id": f"{split}-{i:06d}"}}
        for i, p in enumerate(problems)
    ]


# ---- reward ---------------------------------------------------------------------------

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def boxed_integer(response: str) -> int | None:
    """The integer in the last `\\boxed{}` after the last `</think>` (None if absent)."""
    tail = response.rsplit(END_THINK, 1)[-1] if END_THINK in response else response
    found = _BOXED.findall(tail)
    if not found:
        return None
    try:
        return int(found[-1].strip())
    except ValueError:
        return None


# ---- pre-training ---------------------------------------------------------------------


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def pretrain(model: OuroForCausalLM, tokenizer, problems: list[Problem], *, steps: int, seed: int, log=print) -> None:
    """Teacher-forced next-token training; loss on response tokens only.

    A sequence is prompt (m tokens) + response (n tokens, ending in <|im_end|>
    <|endoftext|>, so that generation stops whichever of the two is the stop token).
    Depths are [T]*m + [d]*n: the output at the last prompt position (depth T) scores
    r[0], the output at r[j-1] (depth d) scores r[j] — the decode contract at budget d.
    """
    eot = tokenizer.token_to_id(ENDOFTEXT)
    prompts = [encode(tokenizer, render_prompt(p.prompt)) for p in problems]
    gen = torch.Generator().manual_seed(seed)
    slips = random.Random(seed)
    depth_values = torch.tensor(list(DEPTH_MIX))
    depth_probs = torch.tensor(list(DEPTH_MIX.values()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    model.train()
    start = time.time()
    for step in range(steps):
        lr = LR * min(1.0, (step + 1) / WARMUP) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for group in opt.param_groups:
            group["lr"] = lr
        idx = torch.randint(len(problems), (BATCH,), generator=gen).tolist()
        depth = depth_values[torch.multinomial(depth_probs, BATCH, replacement=True, generator=gen)].tolist()
        batch = []
        for i in idx:
            slip = (slips.randrange(2), slips.choice(SLIPS)) if slips.random() < SLIP_RATE else None
            batch.append((prompts[i], encode(tokenizer, problems[i].response(slip)) + [eot]))
        length = max(len(p) + len(r) for p, r in batch)
        ids = torch.zeros(BATCH, length, dtype=torch.long)
        depths = torch.full((BATCH, length), T, dtype=torch.long)
        targets = torch.full((BATCH, length), -100, dtype=torch.long)
        for row, ((p, r), d) in enumerate(zip(batch, depth, strict=True)):
            m, n = len(p), len(r)
            ids[row, : m + n] = torch.tensor(p + r)
            depths[row, m : m + n] = d
            targets[row, m - 1 : m + n - 1] = torch.tensor(r)
        # Right padding only: causal attention never lets a real token see the padding.
        logits = model(ids, depths=depths)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"  step {step:4d}  loss {loss.item():.4f}  lr {lr:.2e}  ({time.time() - start:.0f}s)")
    model.eval()


# ---- evaluation -----------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: OuroForCausalLM,
    tokenizer,
    rows: list[dict],
    K: int,
    n: int,
    *,
    seed: int = 0,
    temperature: float = 1.0,
    max_new_tokens: int = 32,
) -> float:
    """Exact-answer accuracy of n samples per row at decode budget K (the last `\\boxed{}`
    after the last `</think>` must equal the label).

    This is the generator's own check, not the rollout engine. Rows are grouped by
    prompt length so that no padding is needed.
    """
    stops = torch.tensor([tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)])
    gen = torch.Generator().manual_seed(seed)
    by_length: dict[int, list[tuple[list[int], int]]] = {}
    for row in rows:
        ids = encode(tokenizer, render_prompt(row["prompt"]))
        by_length.setdefault(len(ids), []).extend([(ids, row["label"])] * n)
    correct = total = 0
    for _, group in sorted(by_length.items()):
        prompts = torch.tensor([ids for ids, _ in group])
        responses = sample(model, prompts, K, stops, gen, temperature=temperature, max_new_tokens=max_new_tokens)
        for response, (_, label) in zip(responses.tolist(), group, strict=True):
            correct += boxed_integer(tokenizer.decode(response, skip_special_tokens=True)) == label
            total += 1
    return correct / total


@torch.no_grad()
def sample(
    model: OuroForCausalLM,
    prompts: torch.Tensor,
    K: int,
    stops: torch.Tensor,
    gen: torch.Generator,
    *,
    temperature: float,
    max_new_tokens: int,
) -> torch.Tensor:
    """prompts [B, m] -> sampled tokens [B, <= max_new_tokens] (0 after a stop token).

    docs/model.md §3 with a uniform budget K: the prompt is prefilled at depth T (its K/V kept
    per loop and layer), the first token is sampled from its last position, and every
    later token runs K loops, attending at loop t to plane t of all earlier tokens.
    Planes past K are never read, so they are not extended.
    """
    planes: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def keep(t: int, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        planes[t, i] = (k, v)

    logits = model(prompts, kv_sink=keep)[:, -1]
    position = prompts.shape[1]
    done = torch.zeros(prompts.shape[0], dtype=torch.bool)
    out = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        token = torch.multinomial(probs, 1, generator=gen).squeeze(1).masked_fill(done, 0)
        out.append(token)
        done |= torch.isin(token, stops)
        if bool(done.all()):
            break
        h = model.embed(token[:, None])
        cos, sin = model.rope(torch.full_like(token[:, None], position), h.dtype)
        for t in range(1, K + 1):
            h = model.run_loop(h, cos, sin, lambda i, t=t: _cached_attend(planes, t, i))
        logits = model.logits(h)[:, -1]
        position += 1
    return torch.stack(out, dim=1)


def _cached_attend(planes, t: int, i: int):
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        past_k, past_v = planes[t, i]
        k, v = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        planes[t, i] = (k, v)
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])  # one query: sees all
        return o.transpose(1, 2)

    return attend


# ---- files ----------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def model_config():
    return tiny_config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        total_ut_steps=T,
        max_position_embeddings=512,
        rope_theta=10000.0,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=BUNDLE, help="where to write (default: ouro_cli/bundled/tiny)")
    parser.add_argument("--eval-samples", type=int, default=4, help="samples per held-out prompt for the report")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(SEED)
    began = time.time()

    out: Path = args.out
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)

    train, held_out = split_problems(SEED)
    train_rows, eval_rows = jsonl_rows(train, "train"), jsonl_rows(held_out, "eval")
    write_jsonl(out / "train.jsonl", train_rows)
    write_jsonl(out / "eval.jsonl", eval_rows)
    print(f"task: {len(train_rows)} train / {len(eval_rows)} eval problems")

    tokenizer = build_tokenizer()
    config = model_config()
    model = build(config, seed=SEED, std=0.02)
    print(f"model: {sum(p.numel() for p in model.parameters()):,} parameters, T={T}")
    pretrain(model, tokenizer, train, steps=TRAIN_STEPS, seed=SEED)

    with tempfile.TemporaryDirectory() as tmp:  # assets travel through write_hf's copy
        assets = Path(tmp)
        tokenizer.save(str(assets / "tokenizer.json"))
        (assets / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2, sort_keys=True) + "\n")
        generation = {"bos_token_id": 0, "eos_token_id": [2, 0], "pad_token_id": 0}
        (assets / "generation_config.json").write_text(json.dumps(generation, indent=2, sort_keys=True) + "\n")
        write_hf(model_dir, config, model.state_dict().items(), assets_from=assets)

    files = [
        "model/config.json",
        "model/generation_config.json",
        "model/model.safetensors",
        "model/tokenizer.json",
        "model/tokenizer_config.json",
        "train.jsonl",
        "eval.jsonl",
    ]
    (out / "SHA256SUMS").write_text("".join(f"{sha256(out / f)}  {f}\n" for f in files))
    print(f"wrote {out} in {time.time() - began:.0f}s")

    for K in range(1, T + 1):
        acc = evaluate(model, tokenizer, eval_rows, K, args.eval_samples, seed=SEED)
        print(
            f"held-out accuracy K={K}: {acc:.3f}  ({len(eval_rows)} prompts x {args.eval_samples} samples, "
            f"temperature 1.0)"
        )
    print(f"model.safetensors sha256 {sha256(model_dir / 'model.safetensors')}")
    print(f"total {time.time() - began:.0f}s")


if __name__ == "__main__":
    main()
