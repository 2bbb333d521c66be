# Sourced by device scripts that read the sample corpus: preprocesses datasets/python-docs.jsonl.xz with
# GPT-2 BPE into /tmp/corpus/gpt2_text_document (the --corpus of bench scenario d), in ~2 s.
CORPUS=/tmp/corpus/gpt2_text_document
python3 -m trainer.preprocess --input datasets/python-docs.jsonl.xz --output-prefix /tmp/corpus/gpt2 \
    --tokenizer-type GPT2BPETokenizer --vocab-file datasets/gpt2/vocab.json --merge-file datasets/gpt2/merges.txt \
    --append-eod --workers 4 2>&1 | tail -1
