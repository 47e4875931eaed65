#!/usr/bin/env bash
# Build the SQLite a Jetson TX2's Ubuntu 18.04 (JetPack 4.6) ships, near enough, into DIR:
#   build_sqlite.sh DIR
# Ubuntu 18.04 has SQLite 3.22.0. No package registry here carries that release; npm's
# better-sqlite3 4.1.1 carries SQLite's own 3.21.0 source tarball (sqlite-autoconf-3210000),
# the release before it and older in every feature odtd's schema may use (3.22 added none it
# does; 3.24's upsert, 3.25's column rename and 3.26's new table rename all come later). It is
# compiled with the options Debian's package sets (JSON1 among them: the store's queries use
# json_each). `make test-tx2` runs the daemon's tests on it (LD_LIBRARY_PATH=DIR/lib) where npm
# and a C compiler are here. Needs: npm (the registry only), cc, make.
set -euo pipefail
dir=${1:?usage: build_sqlite.sh DIR}
want=3.21.0
package=better-sqlite3@4.1.1
tarball=package/deps/sqlite-autoconf-3210000.tar.gz
tarball_sha256=d7dd516775005ad87a57f428b6f86afd206cb341722927f104d3f0cf65fbbbe3
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
echo "+ npm pack $package (for its $(basename "$tarball"))"
packed=$(npm pack --silent "$package")
tar xzf "$packed" "$tarball"
echo "$tarball_sha256  $tarball" | sha256sum --check --quiet
tar xzf "$tarball"
cd "$(basename "$tarball" .tar.gz)"
CFLAGS="-O2 -DSQLITE_SECURE_DELETE -DSQLITE_ENABLE_COLUMN_METADATA -DSQLITE_ENABLE_FTS3 \
-DSQLITE_ENABLE_FTS3_PARENTHESIS -DSQLITE_ENABLE_RTREE=1 -DSQLITE_SOUNDEX=1 \
-DSQLITE_ENABLE_UNLOCK_NOTIFY -DSQLITE_ENABLE_DBSTAT_VTAB -DSQLITE_ENABLE_UPDATE_DELETE_LIMIT=1 \
-DSQLITE_ENABLE_LOAD_EXTENSION -DSQLITE_ENABLE_JSON1 -DSQLITE_LIKE_DOESNT_MATCH_BLOBS \
-DSQLITE_THREADSAFE=1 -DSQLITE_USE_URI=1 -DSQLITE_MAX_SCHEMA_RETRY=25 \
-DSQLITE_MAX_VARIABLE_NUMBER=250000" ./configure --quiet --prefix="$dir" --disable-static >/dev/null
echo "+ make (SQLite $want into $dir)"
make --quiet >/dev/null 2>&1
make --quiet install >/dev/null
grep -q "#define SQLITE_VERSION *\"$want\"" "$dir/include/sqlite3.h"
echo "SQLite $want in $dir/lib"
