"""The scheduler: queues, continuous batching, chunked prefill, retraction."""

from minisgl.scheduler.batch import Batch
from minisgl.scheduler.req import Req, ReqStatus
from minisgl.scheduler.scheduler import NEED_SYNC, Scheduler

__all__ = ["Batch", "Req", "ReqStatus", "Scheduler", "NEED_SYNC"]
