"""Building blocks of the worker's models: norms, rotary embedding, paged attention."""
