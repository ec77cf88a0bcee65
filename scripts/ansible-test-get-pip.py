"""A stand-in for the get-pip.py that ansible-test downloads to bootstrap pip in its venvs.

ansible-test (sanity, units) builds a virtual environment per sanity test and bootstraps pip in it
by running get-pip.py, which it downloads from a host that only Ansible's CI uses and that this
network does not reach (docs/COLLECTION.md, "ansible-test"). It runs a cached copy instead when
one is at ~/.ansible/test/cache/get_pip_<version>.py: scripts/ansible-test.sh puts this file
there, under a HOME of its own. It does what get-pip.py does with Python's own means: ensurepip
installs the pip that Python carries, and that pip installs the packages ansible-test asked for
(the pip version it pins) from the index the machine's pip configuration names.
"""

import subprocess
import sys

# get-pip.py's own options (it installs setuptools and wheel unless told not to); pip install
# knows neither, and a venv from ensurepip has neither anyway.
GET_PIP_ONLY = {"--no-setuptools", "--no-wheel"}


def main() -> int:
    """Bootstrap pip in the running Python, then install what ansible-test asked for."""
    pip_args = [arg for arg in sys.argv[1:] if arg not in GET_PIP_ONLY]
    ensurepip = [sys.executable, "-m", "ensurepip", "--upgrade", "--default-pip"]
    subprocess.run(ensurepip, check=True, stdout=subprocess.DEVNULL)
    install = [sys.executable, "-m", "pip", "install", "--quiet", *pip_args]
    return subprocess.run(install, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
