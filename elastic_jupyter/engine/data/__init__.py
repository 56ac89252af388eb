"""The data wing: which samples each rank reads at each step, and how they reach it.

``batching`` is the batch plan (every step's samples, cut into passes, whatever the world
size), ``randomness`` the random streams per micro-batch, ``digest`` and ``fingerprint`` a
dataset's identity across engines. A map-style dataset is read by ``map_pipeline`` (a torch
DataLoader over the rank's passes); an iterable one is split once into a fixed number of
streams (``stream_split``) and read forwards by ``stream_pipeline``. ``to_device`` moves a
batch to the rank's device without changing its structure.
"""
