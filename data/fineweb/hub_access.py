"""
The Hugging Face Hub out of reach, in one line: prepare.py (streaming FineWeb) and download.py
(fetching shards) both check the Hub before starting and report a failure the same way, with the
way out that works without it.
"""

import sys

HUB_UNREACHABLE = 3  # exit status when the Hub cannot be read, so that scripts can suggest local files


def one_line(e):
    """An exception in one line: the libraries' own tracebacks run to dozens of lines and bury the way out."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def exit_unreachable(repo_id, e, instead):
    print(f"cannot read {repo_id} from the Hugging Face Hub ({one_line(e)}); without Hub access, {instead}",
          file=sys.stderr)
    sys.exit(HUB_UNREACHABLE)


def check_hub(repo_id, instead):
    """Exit at once when the dataset repo cannot be read: load_dataset and hf_hub_download retry for half
    a minute first. One metadata request, which fails fast offline and honours the proxy settings as the
    real requests would. `instead` says what to do without the Hub."""
    from huggingface_hub import HfApi  # slow to import, and not needed for local files
    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except Exception as e:
        exit_unreachable(repo_id, e, instead)
