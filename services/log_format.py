"""Log lines as text or as one JSON object per line (``--log-format``), in every weft process.

``weft serve --log-format json`` (or ``engine-core --headless --log-format json``) sets
``WEFT_LOG_FORMAT`` for the processes it starts, so its engine cores and their
tensor-parallel workers log the same way. A JSON line holds the time (ISO 8601, UTC),
the level, the logger, the message, the process's data-parallel ``rank`` where it has
one, the ``request_id`` where the line is about one request (the API's current request,
or ``extra={"request_id": ...}``), and ``exc_info`` as text. Torch-free.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging

from services import env

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# The id of the HTTP request whose code is running (set by the API's request-id middleware).
current_request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


class JSONFormatter(logging.Formatter):
    def __init__(self, rank: int | None = None, process: str | None = None) -> None:
        super().__init__()
        self.rank = rank
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if self.process is not None:
            line["process"] = self.process
        if self.rank is not None:
            line["rank"] = self.rank
        request_id = getattr(record, "request_id", None) or current_request_id.get()
        if request_id is not None:
            line["request_id"] = request_id
        if record.exc_info:
            line["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def log_format(given: str | None = None) -> str:
    """``given``, else ``$WEFT_LOG_FORMAT``, else text; ValueError for anything else."""
    fmt = given or env.get("WEFT_LOG_FORMAT", "text")
    if fmt not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}.")
    return fmt


def configure(
    fmt: str | None = None,
    *,
    rank: int | None = None,
    process: str | None = None,
    text_format: str = TEXT_FORMAT,
) -> str:
    """Set up the root logger at INFO in format ``fmt`` (see ``log_format``) and pass the
    format on to the processes this one starts; returns it. ``process`` and ``rank`` name
    this process in JSON lines; ``text_format`` is the text lines' format."""
    fmt = log_format(fmt)
    handler = logging.StreamHandler()
    handler.setFormatter(JSONFormatter(rank, process) if fmt == "json" else logging.Formatter(text_format))
    # As basicConfig always does: nothing where the root logger has handlers already (a test run).
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    if fmt == "json":
        logging.captureWarnings(True)  # Python's warnings as log lines too, not bare text on stderr
    env.put("WEFT_LOG_FORMAT", fmt)
    return fmt


def add_log_format_arg(parser) -> None:
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="text",
        help="text, or json: one JSON object per line with time, level, logger, message, and the "
        "request id and data-parallel rank where known; the engine cores started here log the same "
        "way (default: %(default)s).",
    )
