"""The gRPC boundary: converts, validates and delegates to the engine."""

import os

# The daemon logs instead of drawing progress bars: a bar (model conversion) written to the log stream would
# break its one-JSON-object-per-line format. tqdm reads this when it is first imported, so set it here,
# before the server imports the engine and transformers.
os.environ.setdefault("TQDM_DISABLE", "1")
