"""What every batch job shares, whatever it makes: its configuration (presets, `--set`, the settings
echo), atomic writes, the output folder's lock, worker processes, torchrun's ranks, progress and the
package version. A leaf: it imports no other package of the project."""
