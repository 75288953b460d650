"""The stream a worker's event loop writes to its ``--record`` writer process (a pipe):
each recorded step as a small fixed header and its raw bytes, each episode's beginning
and end as a small message of the same shape.

Every message is :data:`HEAD` (22 bytes, little-endian: kind, the episode's recording id,
a flag byte, a float, two lengths) followed by the two byte strings those lengths give:

========= ============================ ============== ====================== ==============
kind      flag                         float          first bytes            second bytes
========= ============================ ============== ====================== ==============
``BEGIN`` 1: JSON frames, 0: MessagePack  Unix time of    MessagePack ``[episode  the reset's
                                        the reset reply  id, seed, options]``    reply frame
``STEP``  1: the step failed           the step's s   the request frame      the reply frame
                                                                             (or the error's
                                                                             UTF-8 text)
``END``   :data:`END_REASONS` index,   0              MessagePack            empty
          +8 clipped, +16 dropped                     ``EpisodeCost``
========= ============================ ============== ====================== ==============

A ``dropped`` end tells the writer the loop could not keep every step of the episode (its
buffer was full): the writer forgets the episode and counts it dropped.
"""

from __future__ import annotations

import struct

from stadium._server.ledger.episode import EndReason

HEAD = struct.Struct("<BIBdII")
"""kind, recording id, flag, float, length of the first bytes, of the second."""
BEGIN, STEP, END = 1, 2, 3
END_REASONS = tuple(EndReason)
"""An ``END``'s flag & 7 indexes this."""
CLIPPED, DROPPED = 8, 16
#: The ids wrap at this (an id is live only while its episode runs).
ID_LIMIT = 1 << 32

__all__ = ["BEGIN", "CLIPPED", "DROPPED", "END", "END_REASONS", "HEAD", "ID_LIMIT", "STEP"]
