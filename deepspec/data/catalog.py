"""The catalogue of prompt sources: where each prompt file a preset can read
comes from (`KNOWN_SOURCES`, keyed by its path under `data.root`) and how a
source row becomes a record (`FORMATS`). The benchmarks are DeepSeek's DeepSpec
``eval_datasets`` (``{"turns": [...]}`` per line); the training files add
``reference`` (the source dataset's response, when it has one). Building the
files from these sources is `deepspec.data.sources`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

BOXED_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class Source:
    """Where one prompt file comes from and how its rows become records."""

    hub: str  # Hugging Face dataset id, or github:<owner>/<repo>
    format: str  # a FORMATS key
    revision: Optional[str] = None  # commit (or tag); None = the default branch
    config: Optional[str] = None
    split: str = "train"
    files: tuple = ()  # files of the repository; () = datasets.load_dataset(hub, config, split)
    sha256: Optional[str] = None  # the reference copy's sha256
    lenient: bool = False  # skip malformed JSONL lines of the source (counted in the log)
    dedup: bool = False  # drop records whose turns repeat an earlier record's

    @property
    def where(self) -> str:
        at = f"@{self.revision}" if self.revision else ""
        what = f" {self.config}/{self.split}" if self.config else (f" {self.split}" if not self.files else "")
        files = f" [{', '.join(self.files)}]" if self.files else ""
        return f"{self.hub}{at}{what}{files}"


# ---------------------------------------------------------------- formats
# Each maps a source row to (turns, reference); None skips the row.


def _with_input(instruction: str, inp: str) -> str:
    """The alpaca format of DeepSpec's eval_datasets: instruction, then the input if any."""
    return f"{instruction}\n\nInput:\n{inp}" if inp else instruction


def _livecodebench(row: dict):
    if "messages" in row:
        return [m["content"] for m in row["messages"] if m["role"] == "user"], None
    starter = row["starter_code"]
    label = "Use the following code structure:" if starter else "Write your code in the following format:"
    return [
        "You are an expert Python programmer. You will be given a question (problem specification) and will "
        "generate a correct Python program that matches the specification and passes all tests. You will NOT "
        "return anything except for the program\n\n"
        f"### Question:\n{row['question_content']}\n\n### Format: {label}\n"
        f"```python\n{starter or '# YOUR CODE HERE'}\n```\n\n### Answer: (use the provided format with backticks)"
    ], None


def _alpaca_libre(row: dict):
    """Generated tasks with status "ok"; <noinput> / <nooutput> mean empty."""
    if row.get("status") != "ok":
        return None
    inp = (row.get("input") or "").strip()
    out = (row.get("output") or "").strip()
    return [_with_input(row["instruction"].strip(), "" if inp == "<noinput>" else inp)], \
        (None if out == "<nooutput>" else out)


FORMATS: dict[str, Callable[[dict], Optional[tuple]]] = {
    "question_boxed": lambda r: ([r["question"] + BOXED_SUFFIX], None),
    "problem_boxed": lambda r: ([r["problem"] + BOXED_SUFFIX], None),
    "alpaca": lambda r: ([_with_input(r["instruction"], r["input"])], None),
    "prompt_turns": lambda r: (list(r["prompt"]), None),
    "humaneval": lambda r: (["Write a solution to the following problem and make sure that it passes the tests:\n"
                             f"```python\n{r['prompt']}\n```"], None),
    "prompt": lambda r: ([r["prompt"]], None),
    "instruction": lambda r: ([r["instruction"]], None),
    "livecodebench": _livecodebench,
    "question_answer": lambda r: ([r["question"]], r["answer"]),
    "instruction_output": lambda r: ([_with_input(r["instruction"], r["input"])], r["output"]),
    "alpaca_libre": _alpaca_libre,
}

_GSM8K_REV = "cc7b047b6e5bb11b4f1af84efc572db110a51b3c"
_LCB_FILES = ("test.jsonl", "test2.jsonl", "test3.jsonl", "test4.jsonl", "test5.jsonl", "test6.jsonl")

# The known sources, keyed by the file's path under data.root. The benchmarks
# are DeepSpec's eval_datasets (deepseek-ai/DeepSpec@afdfa7c eval_datasets/);
# revision None where no commit could be pinned offline: the recorded sha256
# then pins the content (a changed upstream is an error naming the file).
KNOWN_SOURCES: dict[str, Source] = {
    "eval/gsm8k.jsonl": Source("openai/gsm8k", "question_boxed", _GSM8K_REV, "main", "test",
                               sha256="63330a20a17f416fdfca978ebcd5124f8da5546affb3a079b65a6e8daf42b41f"),
    "eval/math500.jsonl": Source("HuggingFaceH4/MATH-500", "problem_boxed", "6e4ed1a2a79af7d8630a6b768ec859cb5af4d3be",
                                 split="test", sha256="4f530d9d3126dca41c12a96e78ec0dd460b7202052ba86101c4da159cea33aac"),
    "eval/aime24.jsonl": Source("HuggingFaceH4/aime_2024", "problem_boxed", "2fe88a2f1091d5048c0f36abc874fb997b3dd99a",
                                sha256="98b2449571c23886d67f99224ecdb4e48ad6cf74955b2908f70fbea9d66dead7"),
    "eval/aime25.jsonl": Source("MathArena/aime_2025", "problem_boxed",
                                sha256="b8835996839caa1d982c5bb9ecaeca636424f0b8ed9f33a40b084feb1c1766d0"),
    # DeepSpec's alpaca.jsonl is all 52,002 rows; the reference copy is a 1,000-row stand-in (no reference sha).
    "eval/alpaca.jsonl": Source("tatsu-lab/alpaca", "alpaca", "dce01c9b08f87459cf36a430d809084718273017"),
    "eval/mt-bench.jsonl": Source("HuggingFaceH4/mt_bench_prompts", "prompt_turns",
                                  sha256="df05defbcea350dff39f7d2996a7cba8a029e6e06069dfcdab11ceb998d743b0"),
    "eval/humaneval.jsonl": Source("openai/openai_humaneval", "humaneval", "7dce6050a7d6d172f3cc5c32aa97f52fa1a2e544",
                                   split="test", sha256="7aaed6a3987007ecee4851ee4572fde214aa2a36ae83fa21be9c5f443aa71675"),
    "eval/mbpp.jsonl": Source("google-research-datasets/mbpp", "prompt", "4bb6404fdc6cacfda99d4ac4205087b89d32030c",
                              "sanitized", "test", sha256="019b981f7122e39ce58866cf93f4206511c72532cb537bbaf298753a0f128ba7"),
    "eval/lbpp.jsonl": Source("CohereLabs/lbpp", "instruction", files=("python/test.parquet",),
                              sha256="0b973ef7ec26993896884a2cbfde640706390261778b4dc7a221ccb95b539ae2"),
    "eval/livecodebench.jsonl": Source("livecodebench/code_generation_lite", "livecodebench", files=_LCB_FILES,
                                       sha256="40ed536492f331ac27b3b68506072366ca1d3a304b92c31d822574e778c87318"),
    "eval/arena-hard-v2.jsonl": Source("lmarena-ai/arena-hard-auto", "prompt",
                                       files=("data/arena-hard-v2.0/question.jsonl",),
                                       sha256="e5fcce94ffb1a2ef2082b5c63ac36608f2b7faf00da13ecb94ce2adc649b7b91"),
    # Training prompts ({turns, reference}); each conversion reproduces the reference copy byte for byte.
    "train/gsm8k_train.jsonl": Source("openai/gsm8k", "question_answer", _GSM8K_REV, "main", "train",
                                      sha256="7cc806e66157aa7a779027ab1e58cca0660c2c46804ba7e20bde6017467852cb"),
    "train/code_alpaca_2k.jsonl": Source("github:sahil280114/codealpaca", "instruction_output",
                                         "2f78ddc5c682ed6738ad092bbbfa59ba915afcb0", files=("data/code_alpaca_2k.json",),
                                         sha256="f1fe1782c03531441e6c59ac861eb511ae0e3a450e54f64927314a811107fd4e"),
    "train/chat_alpaca_libre.jsonl": Source(
        "github:mobarski/alpaca-libre", "alpaca_libre", "9024e0cb3b24d8857861b694df643d0bbb765e69",
        files=tuple(f"data/output/work/alpaca_libre_tasks_v{v}.jsonl" for v in (1, 2, 3)),
        sha256="62f29c9f24d32fb28fa1219726027336f8fe80aed0143f5e50fcdd8ef87b567c", lenient=True, dedup=True),
}
