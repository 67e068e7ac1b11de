"""Print the requirements pyproject.toml declares (and those of the extras named), one per line, so the image
installs its dependencies before the source is copied in: `python3 docker/deps.py pyproject.toml gpu`."""

import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
for requirement in project["dependencies"] + [r for extra in sys.argv[2:] for r in project["optional-dependencies"][extra]]:
    print(requirement)
