# generated from notebooks/12_api_features.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/12_api_features.ipynb, cell 3 (id c12-003) ---
"""What happens to a step's logits between the model and the sampler, for the requests that ask for it:
penalties, a grammar's token mask, and the log-probabilities handed back with each token.

- Penalties need to know which tokens a request has already seen. A count table on the device keeps one row
  per request-table row: entry [row, token] holds how many times the request generated `token`, plus
  `PROMPT_BIT` when the token is in its prompt. The host fills a row when a penalised request arrives on it
  (its prompt and whatever it generated before a retraction), and after every step the device adds each
  sampled token to its row: the table is current without ever reading a token back.
- A grammar mask is a bitmask over the vocabulary (bit t of word t // 32: token t is allowed), built on the
  host by the grammar library while the device runs the forward; the tokens it forbids get -inf.
- Logprobs are the log-softmax of the logits after both, before temperature and the top-k/top-p/min-p cuts.

Every function works on a subset of the step's sampling rows (`rows`), so a request that asks for none of this
costs nothing, and a step where no request does skips this module entirely.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl.kernels.elementwise import use_triton

PROMPT_BIT = 1 << 30  # count-table flag: the token is in the prompt (repetition penalty)
COUNT_MASK = PROMPT_BIT - 1  # the low bits: times the token was generated (frequency and presence penalties)


# --- notebooks/12_api_features.ipynb, cell 8 (id c12-008) ---
def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, frequency: torch.Tensor,
                    presence: torch.Tensor, repetition: torch.Tensor) -> None:
    """Penalise `logits[rows]` in place. counts `[P, V]` int32: the count-table rows of those requests;
    frequency, presence, repetition `[P]` float.

    Repetition (Hugging Face): a token seen in the prompt or the output has its logit divided by r when it is
    positive, multiplied by r when negative. Then frequency and presence (OpenAI): with c the number of times
    the token was generated, subtract c * frequency + (c > 0) * presence.
    """
    x = logits[rows].float()
    generated = (counts & COUNT_MASK).float()
    r = repetition[:, None]
    x = torch.where(counts != 0, torch.where(x < 0, x * r, x / r), x)
    x = x - generated * frequency[:, None]
    x = x - (generated > 0).float() * presence[:, None]
    logits[rows] = x.to(logits.dtype)


# --- notebooks/12_api_features.ipynb, cell 12 (id c12-012) ---
def penalty_row_entries(prompt: list[int], outputs: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, values) of a request's count-table row: PROMPT_BIT for prompt tokens, plus each generated
    token's count. Every other entry is 0."""
    values: dict[int, int] = dict.fromkeys(prompt, PROMPT_BIT)
    for t in outputs:
        values[t] = values.get(t, 0) + 1
    return np.fromiter(values.keys(), np.int64, len(values)), np.fromiter(values.values(), np.int64, len(values))


# --- notebooks/12_api_features.ipynb, cell 14 (id c12-014) ---
class PenaltyTable:
    """The count table, one row per request-table row, allocated on first use and grown as rows are needed.

    `owner[row]` is the request whose counts the row holds: a request arriving on a row it does not own (new,
    or back from a retraction on another row) has its row filled from its tokens; one returning to its own row
    finds its counts as it left them, since only penalised requests write the table.
    """

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(0, vocab, dtype=torch.int32, device=device)
        self.owner: dict[int, object] = {}

    def _grow(self, rows: int) -> None:
        if rows <= self.counts.shape[0]:
            return
        grown = torch.zeros(max(rows, 2 * self.counts.shape[0]), self.vocab, dtype=torch.int32, device=self.device)
        grown[:self.counts.shape[0]] = self.counts
        self.counts = grown

    def load(self, reqs: list) -> None:
        """Make the rows of `reqs` (penalised requests of a step, each on its request-table row) current."""
        self._grow(max(r.row for r in reqs) + 1)
        fresh = [r for r in reqs if self.owner.get(r.row) is not r]
        if not fresh:
            return
        rows, tokens, values = [], [], []
        for r in fresh:
            t, v = penalty_row_entries(r.input_ids, r.output_ids)
            rows.append(np.full(len(t), r.row, np.int64))
            tokens.append(t)
            values.append(v)
            self.owner[r.row] = r
        dev = self.device
        self.counts[torch.tensor([r.row for r in fresh], device=dev)] = 0
        where = (torch.from_numpy(np.concatenate(rows)).to(dev), torch.from_numpy(np.concatenate(tokens)).to(dev))
        self.counts[where] = torch.from_numpy(np.concatenate(values)).to(dev, torch.int32)

    def count(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add each row's sampled token (rows distinct: one token per request per step)."""
        self.counts[rows, tokens] += 1


# --- notebooks/12_api_features.ipynb, cell 16 (id c12-016) ---
def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top_n: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each row's token `[L]`, the top_n token ids `[L, top_n]` and their logprobs), from the
    log-softmax of `logits` `[L, V]` in float32."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    chosen = x.gather(1, tokens.view(-1, 1)) - lse
    top_x, top_ids = x.topk(top_n, dim=-1)
    return chosen.view(-1), top_ids, top_x - lse


# --- notebooks/12_api_features.ipynb, cell 19 (id c12-019) ---
def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set `logits[rows]` to -inf where the bitmask `[G, ceil(V / 32)]` (int32) has a 0 bit."""
    vocab = logits.shape[-1]
    idx = torch.arange(vocab, device=logits.device)
    allowed = (bitmask[:, idx >> 5] >> (idx & 31)) & 1
    logits[rows] = logits[rows].masked_fill(allowed == 0, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor, bias: torch.Tensor) -> None:
    """Add `bias[e]` to `logits[rows[e], tokens[e]]` for every entry e (OpenAI's logit_bias; no (row, token)
    twice), in float32 and back to the logits' dtype."""
    logits[rows, tokens] = (logits[rows, tokens].float() + bias).to(logits.dtype)


# --- notebooks/12_api_features.ipynb, cell 20 (id c12-020) ---
@dataclass
class LogitsProcessing:
    """A step's processing, on the device; indices are into the step's sampling rows. None: nobody asks."""

    penalty_rows: torch.Tensor | None = None  # [P] int64
    penalty_slots: torch.Tensor | None = None  # [P] int64: count-table rows
    frequency: torch.Tensor | None = None  # [P] float32
    presence: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None  # [E] int64: one entry per (row, biased token)
    bias_tokens: torch.Tensor | None = None  # [E] int64
    bias: torch.Tensor | None = None  # [E] float32
    mask_rows: torch.Tensor | None = None  # [G] int64
    mask_rows_host: list[int] | None = None
    bitmask: torch.Tensor | None = None  # [G, ceil(V / 32)] int32, filled once the host has built it
    logprob_rows: torch.Tensor | None = None  # [L] int64
    logprob_rows_host: list[int] | None = None  # the same, on the host
    top_n: int = 0  # the most top logprobs a row of the step asks for


# --- notebooks/12_api_features.ipynb, cell 21 (id c12-021) ---
def process_logits(logits: torch.Tensor, proc: LogitsProcessing, table: PenaltyTable | None) -> None:
    """Penalties, then the logit bias, then the grammar mask, in place on the rows that ask: Triton kernels on a
    GPU for the penalties and the mask (one launch each, kernels/sampling.py), the torch functions above elsewhere;
    the bias is a few entries a row, one indexed add everywhere."""
    fused = None
    if use_triton(logits):  # a GPU, or the Triton interpreter under the kernel option triton_on_cpu (tests)
        from minisgl.kernels import sampling as fused
    if proc.penalty_rows is not None:
        if fused is not None:
            fused.apply_penalties_(logits, proc.penalty_rows, proc.penalty_slots, table.counts, proc.frequency,
                                   proc.presence, proc.repetition, COUNT_MASK)
        else:
            apply_penalties(logits, proc.penalty_rows, table.counts[proc.penalty_slots], proc.frequency,
                            proc.presence, proc.repetition)
    if proc.bias_rows is not None:
        apply_logit_bias(logits, proc.bias_rows, proc.bias_tokens, proc.bias)
    if proc.mask_rows is not None:
        if fused is not None:
            fused.apply_token_bitmask_(logits, proc.mask_rows, proc.bitmask)
        else:
            apply_token_bitmask(logits, proc.mask_rows, proc.bitmask)
