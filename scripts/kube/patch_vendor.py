"""Fixes two pieces of vendored code in Kubernetes v1.20.2 that break when built with Go >= 1.18.

1. modern-go/reflect2 v1.0.1 links to reflect.mapiterinit as if it returned an iterator; since Go 1.18 the
   caller allocates it. Without the fix the server crashes on the first custom resource it encodes.
2. The OpenAPI type validators compare reflect.Value headers to decide "zero", and under Go >= 1.18 an empty
   string shares the zero buffer, so "" is rejected as null.
"""

import sys
from pathlib import Path

HITER = """type hiter struct {
	key         unsafe.Pointer
	value       unsafe.Pointer
	t           unsafe.Pointer
	h           unsafe.Pointer
	buckets     unsafe.Pointer
	bptr        unsafe.Pointer
	overflow    *[]unsafe.Pointer
	oldoverflow *[]unsafe.Pointer
	startBucket uintptr
	offset      uint8
	wrapped     bool
	B           uint8
	i           uint8
	bucket      uintptr
	checkBucket uintptr
}
"""


def replace_once(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected exactly one occurrence of {old!r}")
    path.write_text(text.replace(old, new))


def main(root: Path) -> None:
    reflect2 = root / "vendor/github.com/modern-go/reflect2"
    link = reflect2 / "unsafe_link.go"
    replace_once(
        link,
        "func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer) *hiter",
        "func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer, it *hiter)",
    )
    text = link.read_text()
    start = text.index("type hiter struct {")
    end = text.index("}\n", start) + 2
    link.write_text(text[:start] + HITER + text[end:])
    replace_once(
        reflect2 / "unsafe_map.go",
        """	return &UnsafeMapIterator{
		hiter:      mapiterinit(type2.rtype, *(*unsafe.Pointer)(obj)),""",
        """	it := new(hiter)
	mapiterinit(type2.rtype, *(*unsafe.Pointer)(obj), it)
	return &UnsafeMapIterator{
		hiter:      it,""",
    )
    zero_check = (
        "if data == nil || reflect.DeepEqual(reflect.Zero(reflect.TypeOf(data)), reflect.ValueOf(data)) {"
    )
    for rel in (
        "vendor/k8s.io/kube-openapi/pkg/validation/validate/type.go",
        "vendor/github.com/go-openapi/validate/type.go",
    ):
        path = root / rel
        if path.exists():
            replace_once(path, zero_check, "if data == nil {")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
