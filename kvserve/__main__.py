"""`python -m kvserve ...` runs the kvserve command line."""
import sys

from kvserve.entrypoints.cli import main

if __name__ == "__main__":
    sys.exit(main())
