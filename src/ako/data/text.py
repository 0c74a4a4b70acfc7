"""Text for language models: a corpus read from UTF-8 files, its character vocabulary, and the
training and validation sequences as map-style data sets.

`--dataset fortunes` reads Debian's `fortunes` package (the plain fortune files under
/usr/share/games/fortunes, by name, without the `.dat` indexes and `.u8` links); `--dataset
text:PATH` reads a UTF-8 file, or every `.txt` file under a folder (sorted by path). The files
are joined in that order, each ending in a newline.

The split is deterministic: the last `VALIDATION_FRACTION` (10%) of the characters are the
validation text, the rest the training text (as nanoGPT's shakespeare_char); the first 256
sequences of the validation text are evaluated unless `--test-samples` says otherwise. The vocabulary
is every distinct character of the whole text, sorted by code point: token id i is the i-th
(`Vocabulary`). A training sample is a sequence of `context` tokens and its next-token targets,
starting at a multiple of `context` (`TokenWindows`), so an epoch is one pass over the training
text: len(train text) // context sequences, each worker taking its shard of their start
positions, reshuffled every epoch (`ShardSampler`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ako.data.errors import DataError

FORTUNES_DIR = "/usr/share/games/fortunes"
TEXT_PREFIX = "text:"
VALIDATION_FRACTION = 0.1
VALIDATION_SEQUENCES = 256  # evaluated by default: the first 256 validation sequences (nanoGPT's eval_iters idea)
VOCABULARY_FILE = "vocabulary.json"


def is_text(name: str) -> bool:
    """Whether data set `name` is text: "fortunes" or "text:PATH"."""
    return isinstance(name, str) and (name == "fortunes" or name.startswith(TEXT_PREFIX))


class Vocabulary:
    """A character vocabulary: token id i is `chars[i]`.

    Attributes:
        chars: the distinct characters, sorted by code point (a str of length `size`).
    """

    def __init__(self, chars: str):
        self.chars = chars
        self._ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def of(cls, text: str) -> Vocabulary:
        """The vocabulary of every character in `text`."""
        return cls("".join(sorted(set(text))))

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """`text` as token ids, int64 (len(text),). Raises DataError for a character not in the
        vocabulary, naming it."""
        try:
            return torch.tensor([self._ids[c] for c in text], dtype=torch.int64)
        except KeyError as e:
            raise DataError(f"character {e.args[0]!r} is not in the model's vocabulary of {self.size} characters") from None

    def decode(self, ids) -> str:
        """Token ids (a sequence or a 1-D tensor of ints in 0 .. size - 1) as text."""
        return "".join(self.chars[int(i)] for i in ids)

    def save(self, path: str | os.PathLike) -> None:
        """Write the vocabulary as JSON, {"chars": [...]}, atomically."""
        from ako.metrics import write_atomic

        write_atomic(path, json.dumps({"type": "characters", "chars": list(self.chars)}, ensure_ascii=False) + "\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> Vocabulary:
        """Read what `save` wrote. Raises DataError for a missing or damaged file."""
        try:
            chars = json.loads(Path(path).read_text(encoding="utf-8"))["chars"]
            if not (isinstance(chars, list) and all(isinstance(c, str) and len(c) == 1 for c in chars)):
                raise ValueError("chars is not a list of characters")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}: not a vocabulary file ({type(e).__name__}: {e})") from None
        return cls("".join(chars))


class TokenWindows(torch.utils.data.Dataset):
    """Sequences of a token stream: sample i is (x, y), each int64 (context,), with x =
    tokens[i * context : (i + 1) * context] and y the same shifted by one token (the targets).

    Args:
        tokens: int64 (N,), N > context.
        context: tokens per sequence.
        limit: keep only the first `limit` sequences (None: all (N - 1) // context).
    """

    def __init__(self, tokens: torch.Tensor, context: int, limit: int | None = None):
        self.tokens, self.context = tokens, context
        count = (len(tokens) - 1) // context
        self.count = count if limit is None else min(limit, count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self.count <= i < self.count:
            raise IndexError(f"sequence {i} of {self.count}")
        start = (i % self.count) * self.context
        return self.tokens[start : start + self.context], self.tokens[start + 1 : start + self.context + 1]

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences `indices` (int64 (B,)) as one batch: x and y, each int64 (B, context)."""
        if len(indices) and not (0 <= int(indices.min()) and int(indices.max()) < self.count):
            raise IndexError(f"a sequence index is out of range 0..{self.count - 1}")
        offsets = indices.unsqueeze(1) * self.context + torch.arange(self.context + 1)
        rows = self.tokens[offsets]
        return rows[:, :-1], rows[:, 1:]


@dataclass(frozen=True)
class TextSplit:
    """A text corpus split for a language model.

    Attributes:
        train, test: `TokenWindows` of the training and the validation text.
        vocabulary: the character vocabulary of the whole text.
        source: the file or folder read.
        characters: (training, validation) characters.
    """

    train: TokenWindows
    test: TokenWindows
    vocabulary: Vocabulary
    source: str
    characters: tuple[int, int]


def load_text(name: str, context: int, train_samples: int | None = None, test_samples: int | None = None) -> TextSplit:
    """Read data set `name` ("fortunes" or "text:PATH"), split it, and make its sequences of
    `context` tokens. `train_samples`/`test_samples`: keep the first k sequences (by default
    all training sequences, and the first `VALIDATION_SEQUENCES` validation ones: an evaluation
    of all of fortunes' 2,012 takes about 10 s here, each evaluation point).

    Raises:
        DataError (one line): no such file or folder, a folder without `.txt` files, an
        unreadable file, a file that is not UTF-8 text (binary), empty text, or a split too
        short for one sequence of `context` tokens (naming the lengths).
    """
    text, source = _read(name)
    vocabulary = Vocabulary.of(text)
    cut = len(text) - int(len(text) * VALIDATION_FRACTION)
    train_text, test_text = text[:cut], text[cut:]
    for split, part in (("training", train_text), ("validation", test_text)):
        if len(part) <= context:
            raise DataError(f"{source}: its {split} text (the {'last 10%' if split == 'validation' else 'first 90%'} of "
                            f"{len(text)} characters) has {len(part)} characters, too few for one sequence of "
                            f"context {context} (+1): give more text or a smaller --context")  # fmt: skip
    train = TokenWindows(vocabulary.encode(train_text), context, _limit("train", train_samples, train_text, context))
    if test_samples is None:
        test_samples = min(VALIDATION_SEQUENCES, (len(test_text) - 1) // context)
    test = TokenWindows(vocabulary.encode(test_text), context, _limit("test", test_samples, test_text, context))
    return TextSplit(train, test, vocabulary, source, (len(train_text), len(test_text)))


def _limit(split: str, k: int | None, text: str, context: int) -> int | None:
    available = (len(text) - 1) // context
    if k is not None and not 1 <= k <= available:
        raise DataError(f"{split}_samples={k!r} is out of range: choose an integer from 1 to {available} "
                        f"(sequences of context {context})")  # fmt: skip
    return k


def _read(name: str) -> tuple[str, str]:
    """The whole text of data set `name`, and where it came from."""
    if name == "fortunes":
        root = Path(FORTUNES_DIR)
        if not root.is_dir():
            raise DataError(f"fortunes: {FORTUNES_DIR} not found (Debian's package fortunes: apt-get install fortunes)")
        files = sorted(p for p in root.iterdir() if p.is_file() and not p.is_symlink() and p.suffix not in (".dat", ".u8"))
    else:
        path = name[len(TEXT_PREFIX):]
        if not path:
            raise DataError(f"data set {name!r}: give a file or folder after text:, like text:corpus.txt")
        root = Path(path)
        if root.is_dir():
            try:
                files = sorted(p for p in root.rglob("*.txt") if p.is_file())
            except OSError as e:
                raise DataError(f"{path}: cannot read the folder ({e.strerror or e})") from None
            if not files:
                raise DataError(f"{path}: a folder with no .txt files in it")
        elif root.exists():
            files = [root]
        else:
            raise DataError(f"{path}: no such file or folder")
    text = "".join(_read_file(p) for p in files)
    if not text.strip():
        raise DataError(f"{FORTUNES_DIR if name == 'fortunes' else name[len(TEXT_PREFIX):]}: the text is empty")
    return text, str(root)


def _read_file(path: Path) -> str:
    """One file's text, ending in a newline. Raises DataError for an unreadable or binary file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    if b"\0" in data:
        raise DataError(f"{path}: a binary file (it holds NUL bytes), not UTF-8 text")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") from None
    return text if text.endswith("\n") or not text else text + "\n"
