# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 4 (id c05-004) ---
"""One step's work, as the scheduler hands it to the model runner."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.scheduler.req import Req


# --- notebooks/05_scheduler.ipynb, cell 12 (id c05-012) ---
@dataclass
class Batch:
    """A flat batch: request i computes `extend_lens[i]` tokens at positions `prefix_lens[i]:...`.

    Requests listed in `sample_rows` produce a next token from the logits of their last token; a request
    in the middle of a chunked prefill computes KV only. The token ids are not here: the model runner reads
    them from the token-id table on the device, at (request row, position).
    """

    step_id: int
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: list[int]  # flat: slot for each new token's K/V
    sample_rows: list[int]  # indices into reqs of the requests that sample this step

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    @property
    def size(self) -> int:
        return len(self.reqs)
