# Source this on a GPU machine without network access to import the checkout as `zipage`
# (pip cannot build an editable install offline): a package tree under /tmp/zipage-src that links
# sim/, kernels/ and analysis/ as zipage.sim, zipage.kernels and zipage.analysis, as pyproject.toml maps them.
#   . bench/env.sh && python bench/headline_gpu.py
# Run `python -m zipage.cli ...` from another directory (cd /tmp): from the repository root the
# checkout's own zipage/ (without sim/ inside) would shadow this tree.
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf /tmp/zipage-src && mkdir -p /tmp/zipage-src/zipage
for entry in "$root"/zipage/*; do ln -s "$entry" /tmp/zipage-src/zipage/; done
ln -s "$root/sim" /tmp/zipage-src/zipage/sim
ln -s "$root/kernels" /tmp/zipage-src/zipage/kernels
ln -s "$root/analysis" /tmp/zipage-src/zipage/analysis
export PYTHONPATH="/tmp/zipage-src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
