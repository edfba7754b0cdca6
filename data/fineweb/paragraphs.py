"""
Plain text (a whole book or play) cut at paragraph breaks into documents of a few KB, the size of
FineWeb's web pages, so that a local corpus exercises the tokenizer the way FineWeb does. Used by
bench_tokenize.py and the tests.
"""


def split_into_documents(text, doc_chars):
    """Consecutive paragraphs joined into documents of at least doc_chars characters, each ending in a
    paragraph break (the last document may be shorter). Joined back, they are the text plus "\\n\\n"."""
    docs, current = [], ""
    for paragraph in text.split("\n\n"):
        current += paragraph + "\n\n"
        if len(current) >= doc_chars:
            docs.append(current)
            current = ""
    return docs + [current] if current else docs
