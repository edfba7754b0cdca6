"""
The Hugging Face Hub out of reach, in one line: prepare.py (streaming FineWeb), download.py (fetching
shards) and eval/downstream.py (task data) check the Hub before starting, with one metadata request,
and report a failure with the way out that works without it, instead of retrying for half a minute and
ending in a 40-line traceback.
"""

import sys

import exits


def hub_problem(repo_id):
    """Why the dataset repo cannot be read from the Hub, in one line, or None. One metadata request,
    which fails fast offline and honours the proxy settings as the real requests would."""
    from huggingface_hub import HfApi  # slow to import, and not needed for local files
    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except Exception as e:
        return exits.one_line(e)
    return None


def exit_unreachable(repo_id, reason, instead):
    """One line naming the repo, the reason and what to do without the Hub (`instead`); exit status 3."""
    print(f"cannot read {repo_id} from the Hugging Face Hub ({reason}); without Hub access, {instead}",
          file=sys.stderr)
    sys.exit(exits.STOPPED)


def check_hub(repo_id, instead):
    """Exit at once when the dataset repo cannot be read: load_dataset and hf_hub_download retry first."""
    problem = hub_problem(repo_id)
    if problem:
        exit_unreachable(repo_id, problem, instead)
