#!/usr/bin/env bash
# The wheels to execute the course notebooks on a GPU machine without network (lab/course/h200.py):
# nbclient + nbformat + ipykernel + IPython + plotly + ipywidgets and their dependencies, for CPython 3.12 on
# manylinux x86_64, each pinned, no dependency resolution (--no-deps), binary wheels only.
#
#   lab/course/wheels.sh DIR        # download into DIR (about 12 MB), then carry DIR to the machine:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site python3 -m lab.course.h200 --out reports/h200/course
#
# Left out because the H200 image already has them (KINDS.md, "Python packages already there"): numpy, torch,
# transformers, jinja2, markupsafe, pyyaml, packaging, psutil, pygments, tqdm, requests, rich, pytest, attrs,
# python-dateutil, six, narwhals, typing-extensions. Left out on purpose: jupyterlab/notebook (no browser
# there), nbconvert (executed notebooks are kept as .ipynb JSON), nbval and nbgrader (h200_course.py runs the
# notebooks with nbclient and the graders with pytest; autograding is not part of the GPU run).
set -euo pipefail
DIR=${1:?usage: lab/course/wheels.sh DIR}
mkdir -p "$DIR"

# name==version; binary ones (pyzmq, tornado, rpds-py, debugpy) get the cp312 manylinux wheel
WHEELS=(
  # executing notebooks
  nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 jupyter_core==5.9.1 traitlets==5.15.0
  platformdirs==4.14.9 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1
  referencing==0.37.0 rpds-py==0.30.0 pyzmq==27.3.0 tornado==6.6.1
  # the kernel
  ipykernel==7.4.0 comm==0.2.3 debugpy==1.8.22 matplotlib-inline==0.2.2 nest-asyncio==1.6.0
  ipython==8.37.0 decorator==5.2.1 jedi==0.19.2 parso==0.8.4 pexpect==4.9.0 ptyprocess==0.7.0
  prompt_toolkit==3.0.52 wcwidth==0.2.13 stack_data==0.6.3 executing==2.2.1 asttokens==3.0.1 pure_eval==0.2.3
  # what the notebooks import
  plotly==6.3.1 ipywidgets==8.1.7 widgetsnbextension==4.0.14 jupyterlab_widgets==3.0.15
)

for spec in "${WHEELS[@]}"; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d "$DIR" "$spec"
done
ls "$DIR"/*.whl | wc -l | xargs echo "wheels:"
du -sh "$DIR" | cut -f1 | xargs echo "size:"
