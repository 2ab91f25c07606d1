#!/bin/sh
# The dependency graph of idem's own source files, and its cycles.
#
#   sh test/include_graph.sh          # from the repository root
#   sh test/include_graph.sh --dot    # the graph in Graphviz DOT, cycles in red
#
# C (src/, guard/): a module is foo.c with foo.h (either may be missing);
# foo -> bar when foo.c or foo.h has #include "bar.h" naming a file of the
# tree (resolved from the including file's directory; PostgreSQL's and the
# system's headers are not part of the graph).  A file including its own
# module's header is no edge.
# Node (clients/node/index.js, clients/node/lib/*.js): a module is a file;
# a -> b when a has require('./b') or require('../b'), at top level or
# inside a function alike.
#
# Prints each cycle with the lines that make it, then one line:
# "include graph: N modules, no cycle" (exit 0) or
# "include graph: N modules, N cycles" (exit 1).
set -u
top=$(cd "$(dirname "$0")/.." && pwd)
cd "$top" || exit 2
dot=0
case "${1:-}" in
--dot) dot=1 ;;
"") ;;
*) echo "usage: sh test/include_graph.sh [--dot]" >&2; exit 2 ;;
esac

exec perl -w - "$dot" <<'EOF'
use strict;

my $dot = shift @ARGV;
my (%node, %edge, %why);	# node; edge{a}{b}; why{a}{b} = [ "file:line ..." ]

# Normalise a relative path: drop "." and resolve "dir/..".
sub canon {
	my @out;
	for my $p (split m{/}, shift) {
		next if $p eq '' || $p eq '.';
		if ($p eq '..' && @out && $out[-1] ne '..') { pop @out; next; }
		push @out, $p;
	}
	return join '/', @out;
}

sub dirof { my $f = shift; return $f =~ m{^(.*)/[^/]*$} ? $1 : '.'; }

sub add_edge {
	my ($from, $to, $where) = @_;
	return if $from eq $to;
	$edge{$from}{$to} = 1;
	push @{ $why{$from}{$to} }, $where;
}

# C: one node per module (foo.c and foo.h together).
my @cfiles = sort grep { -f } map { glob "$_/*.c $_/*.h" } qw(src guard);
die "include_graph.sh: no C files under src/ or guard/\n" unless @cfiles;
for my $f (@cfiles) { (my $m = $f) =~ s/\.[ch]$//; $node{$m} = 1; }
my %scanned;
while (defined(my $f = shift @cfiles)) {
	next if $scanned{$f}++;
	(my $m = $f) =~ s/\.[ch]$//;
	open my $fh, '<', $f or die "include_graph.sh: $f: $!\n";
	while (<$fh>) {
		next unless /^\s*#\s*include\s*"([^"]+)"/;
		my $inc = $1;
		my $target = canon(dirof($f) . "/$inc");
		next unless -f $target;		# a PostgreSQL or system header
		(my $to = $target) =~ s/\.[ch]$//;
		$node{$to} = 1;
		push @cfiles, $target;	# its own includes count too
		add_edge($m, $to, "$f:$. includes \"$inc\"");
	}
	close $fh;
}

# Node: one node per file.
my @jsfiles = sort grep { -f } ('clients/node/index.js', glob 'clients/node/lib/*.js');
for my $f (@jsfiles) { $node{$f} = 1; }
for my $f (@jsfiles) {
	open my $fh, '<', $f or die "include_graph.sh: $f: $!\n";
	while (my $line = <$fh>) {
		next if $line =~ m{^\s*(//|/?\*)};	# a comment line
		while ($line =~ /\brequire\s*\(\s*(['"])(\.\.?\/[^'"]*)\1\s*\)/g) {
			my $req = $2;
			my $base = canon(dirof($f) . "/$req");
			my ($target) = grep { -f } ($base, "$base.js", "$base/index.js");
			next unless defined $target;
			$node{$target} = 1;
			add_edge($f, $target, "$f:$. requires '$req'");
		}
	}
	close $fh;
}

my @nodes = sort keys %node;
sub succ { my $n = shift; return sort keys %{ $edge{$n} || {} }; }

# Strongly connected components (Tarjan): every cycle lies inside one.
my ($index, @stack, %idx, %low, %on, %comp) = (0);
sub strong {
	my $v = shift;
	$idx{$v} = $low{$v} = $index++;
	push @stack, $v;
	$on{$v} = 1;
	for my $w (succ($v)) {
		if (!defined $idx{$w}) {
			strong($w);
			$low{$v} = $low{$w} if $low{$w} < $low{$v};
		} elsif ($on{$w}) {
			$low{$v} = $idx{$w} if $idx{$w} < $low{$v};
		}
	}
	if ($low{$v} == $idx{$v}) {
		my $w;
		do { $w = pop @stack; $on{$w} = 0; $comp{$w} = $v; } while ($w ne $v);
	}
}
for my $n (@nodes) { strong($n) unless defined $idx{$n}; }

if ($dot) {
	print "digraph idem {\n";
	for my $n (@nodes) {
		print "\t\"$n\";\n";
		for my $w (succ($n)) {
			my $red = $comp{$w} eq $comp{$n} ? ' [color=red]' : '';
			print "\t\"$n\" -> \"$w\"$red;\n";
		}
	}
	print "}\n";
	exit 0;
}

# Every elementary cycle, each once: from its smallest node, through larger
# nodes of the same component only.
my @cycles;
my $limit = 100;
for my $s (@nodes) {
	my @path = ($s);
	my %seen = ($s => 1);
	my $walk;
	$walk = sub {
		my $v = shift;
		for my $w (succ($v)) {
			return if @cycles >= $limit;
			next unless $comp{$w} eq $comp{$s} && $w ge $s;
			if ($w eq $s) { push @cycles, [ @path, $s ]; next; }
			next if $seen{$w};
			$seen{$w} = 1;
			push @path, $w;
			$walk->($w);
			pop @path;
			$seen{$w} = 0;
		}
	};
	$walk->($s);
	undef $walk;
}

for my $c (@cycles) {
	print "cycle: ", join(' -> ', @$c), "\n";
	for my $i (0 .. $#$c - 1) {
		print "    $_\n" for @{ $why{ $c->[$i] }{ $c->[$i + 1] } };
	}
}
my $n = @nodes;
if (!@cycles) {
	print "include graph: $n modules, no cycle\n";
	exit 0;
}
my $count = @cycles >= $limit ? "$limit or more cycles" : @cycles == 1 ? "1 cycle" : @cycles . " cycles";
print "include graph: $n modules, $count\n";
exit 1;
EOF
