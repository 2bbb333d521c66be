"""Data for training: offline tokenizers, JSONL -> indexed-dataset preprocessing, sample-indexed datasets.

The datasets are indexed by sample number (the DPP runtime fetches microbatch ``m`` by index, never by
``next()``), and every sample is a pure function of ``(index, seed)``.
"""
