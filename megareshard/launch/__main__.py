"""``python -m megareshard.launch [torchrun's arguments] SCRIPT [ARGS]``: see megareshard/launch/launcher.py."""
import sys

from megareshard.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
