"""Fixed grounded prompts for the ``single_grounded`` workload: answers that copy the input.

Edit a code file, correct a document, answer from a document by quoting it: what batch-1 users
of a local model do, and what prompt lookup (``--speculative-method ngram``) speeds up.
"""

from __future__ import annotations

CODE_FILE = '''\
def parse_size(text):
    """Parse a size such as 2GiB, 512MiB or 1048576 into bytes."""
    units = {"": 1, "b": 1, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3}
    text = text.strip().lower()
    number = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(number):]
    if unit not in units:
        raise ValueError(f"unknown unit {unit!r} in {text!r}")
    return int(float(number) * units[unit])


def format_size(num_bytes):
    """Format a byte count with the largest unit that keeps it above one."""
    for unit, scale in (("GiB", 1024 ** 3), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} B"


def blocks_needed(num_tokens, block_size):
    """Blocks of block_size tokens that hold num_tokens tokens."""
    return (num_tokens + block_size - 1) // block_size
'''

DOCUMENT = """\
The city library opens at nine in the morning on weekdays and at ten on Saturdays. It is closed
on Sundays and on public holidays. Members may borrow up to eight books at a time for three
weeks, and may renew each loan twice online unless another member has reserved the book. Late
returns cost twenty cents per book per day, up to a limit of five dollars per book. The reading
room on the second floor is reserved for quiet study; group study rooms on the first floor can
be booked for two hours at a time. Printing costs ten cents per page in black and white and
fifty cents per page in colour. Children under twelve need a parent or guardian to sign their
membership form. The library café on the ground floor serves coffee, tea and sandwiches until
four in the afternoon."""

ARTICLE = """\
Paged attention stores the key and value cache of a language model in fixed-size blocks instead
of one contiguous buffer per sequence. A block table maps each sequence's logical blocks to
physical blocks in a shared pool, so memory is allocated only as a sequence grows and is returned
the moment it finishes. Because blocks are small, the memory wasted inside a sequence's last
block is at most one block, and many more sequences fit in the same memory. Blocks whose tokens
are identical can be shared: a prompt prefix that many requests have in common is computed once
and every request reads the same physical blocks, found by a hash of the block's tokens and of
all the tokens before it. When memory runs out, the scheduler preempts a sequence, frees its
blocks and recomputes it later."""

# The notice with three spelling mistakes, to be returned corrected.
DOCUMENT_WITH_TYPOS = (
    DOCUMENT.replace("morning", "mornnig")
    .replace("borrow", "borow")
    .replace("library", "libary", 1)
)

# (user message, output tokens): each answer mostly copies spans of its input.
GROUNDED_TASKS: tuple[tuple[str, int], ...] = (
    (
        "Here is a Python file:\n\n"
        + CODE_FILE
        + "\nRename the function blocks_needed to num_blocks_needed and return the whole "
        "file, unchanged otherwise.",
        192,
    ),
    (
        "Correct the spelling mistakes in this notice and return the whole corrected notice:\n\n"
        + DOCUMENT_WITH_TYPOS,
        128,
    ),
    (
        "Here is a document:\n\n"
        + ARTICLE
        + "\n\nWhat happens when memory runs out, and how are prefixes shared? Answer by "
        "quoting the document.",
        128,
    ),
)
