# generated from notebooks/05_scheduler.ipynb by autograder/course.py export — edit the notebook, not this file
# --- notebooks/05_scheduler.ipynb, cell 4 (id c05-004) ---
"""One step's work, as the scheduler hands it to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.scheduler.req import Req


# --- notebooks/05_scheduler.ipynb, cell 12 (id c05-012) ---
@dataclass
class Batch:
    """A flat batch: request i computes `extend_lens[i]` tokens at positions `prefix_lens[i]:...`.

    Requests listed in `sample_rows` produce a next token from the logits of their last token; a request
    in the middle of a chunked prefill computes KV only.
    """

    step_id: int
    reqs: list[Req]
    prefix_lens: list[int]
    extend_lens: list[int]
    input_ids: list[int]  # flat; 0 where the token is still on the device (see pending_*)
    out_cache_loc: list[int]  # flat: slot for each new token's K/V
    sample_rows: list[int]  # indices into reqs of the requests that sample this step
    pending_dst: list[int] = field(default_factory=list)  # flat positions whose id is a pending token
    pending_src: list[int] = field(default_factory=list)  # its row in the previous step's sampled tokens

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.extend_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def size(self) -> int:
        return len(self.reqs)
