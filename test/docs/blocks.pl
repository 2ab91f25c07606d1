#!/usr/bin/perl
# The fenced code blocks of the documentation, for test/docs.sh.
#
#   perl test/docs/blocks.pl list FILE...    one line per block of a checked language
#   perl test/docs/blocks.pl check FILE...   fails if such a block is neither run nor norun
#   perl test/docs/blocks.pl extract DIR FILE...
#   perl test/docs/blocks.pl expect EXPECTED LOG
#
# A block's info string is its language, then "run" (test/docs.sh runs
# it) or "norun" (it does not; "norun: why" says why).  After "run":
# "as=ROLE" (SQL: connect as ROLE instead of the superuser), "continues"
# (the program is the file's previous run block of the same language
# followed by this one), "serve=PATH" (JavaScript: the server it starts is
# sent a request twice, see test/docs/serve.cjs), "fresh" (shell: run as
# root on a fresh Debian 12 machine, test/fresh.sh).  GitHub renders the
# language and ignores the rest.
#
# A block "```text output" right after a run block is what that block
# prints: its lines must come in its output in that order (other lines
# may come between them).
#
# extract writes each run block to DIR/NNN.LANG, with every line of its
# chain of "continues" blocks before it, and DIR/index with one line per
# run block: NNN, the tab-separated file, line of the opening fence,
# language and options; DIR/NNN.expected is its output block, if any.
#
# go TEMPLATE BLOCK FILE LINE prints the Go program of a block
# (test/docs/main.go.in).
use strict;
use warnings;

# Languages whose blocks must say run or norun; the aliases they go by.
my %lang = (sql => 'sql', psql => 'sql', python => 'python', py => 'python',
	js => 'js', javascript => 'js', mjs => 'js', go => 'go', sh => 'sh',
	shell => 'sh', bash => 'sh', console => 'sh', c => 'c');

sub blocks
{
	my ($file) = @_;
	open(my $fh, '<', $file) or die "$file: $!\n";
	my (@out, $cur, $fence, $indent);
	my $n = 0;
	while (my $line = <$fh>)
	{
		$n++;
		if (!$cur)
		{
			next unless $line =~ /^( {0,3})(`{3,}|~{3,})\s*([^`]*?)\s*$/;
			my $info;
			($indent, $fence, $info) = ($1, $2, $3);
			my ($word, $mark, @opts) = split ' ', $info;
			$mark = '' unless defined $mark;
			$mark =~ s/:$//;
			$cur = {file => $file, line => $n, info => $info,
				lang => defined $word ? $lang{lc $word} : undef,
				mark => $mark, opts => $mark eq 'run' ? \@opts : [], text => ''};
			next;
		}
		if ($line =~ /^ {0,3}(`{3,}|~{3,})\s*$/ && substr($1, 0, 1) eq substr($fence, 0, 1)
			&& length($1) >= length($fence))
		{
			push @out, $cur if $cur->{lang} || $cur->{info} =~ /^text\s+output\b/;
			$cur = undef;
			next;
		}
		$line =~ s/^ {0,@{[length $indent]}}//;
		$cur->{text} .= $line;
	}
	die "$file:$cur->{line}: code block not closed\n" if $cur;
	return @out;
}

sub has { my ($b, $w) = @_; return scalar grep { $_ eq $w } @{$b->{opts}}; }

my $cmd = shift // '';
if ($cmd eq 'list' || $cmd eq 'check')
{
	my $bad = 0;
	for my $file (@ARGV)
	{
		for my $b (grep { $_->{lang} } blocks($file))
		{
			my $mark = $b->{mark};
			if ($cmd eq 'list')
			{
				printf "%s:%d\t%s\t%s\n", $file, $b->{line}, $mark || '-', $b->{info};
			}
			elsif ($mark ne 'run' && $mark ne 'norun')
			{
				printf STDERR "%s:%d: a %s block neither run nor norun: write \"%s run\" or \"%s norun: why\"\n",
					$file, $b->{line}, $b->{lang}, ($b->{info} =~ /^(\S+)/) x 2;
				$bad++;
			}
		}
	}
	exit($bad ? 1 : 0);
}
elsif ($cmd eq 'extract')
{
	my $dir = shift;
	open(my $idx, '>', "$dir/index") or die "$dir/index: $!\n";
	my $k = 0;
	for my $file (@ARGV)
	{
		my %prev;    # language => the text of the file's previous run block, with its chain
		my @blocks = blocks($file);
		for my $i (0 .. $#blocks)
		{
			my $b = $blocks[$i];
			next unless $b->{lang} && $b->{mark} eq 'run';
			my $text = $b->{text};
			if (has($b, 'continues'))
			{
				die "$file:$b->{line}: \"continues\" without an earlier $b->{lang} run block\n"
					unless defined $prev{$b->{lang}};
				$text = $prev{$b->{lang}} . $text;
			}
			$prev{$b->{lang}} = $text;
			my $name = sprintf '%03d', ++$k;
			open(my $out, '>', "$dir/$name.$b->{lang}") or die "$dir/$name: $!\n";
			print $out $text;
			close $out;
			# The output block that follows it: what it must print.
			my $next = $blocks[$i + 1];
			if ($next && !$next->{lang})
			{
				open(my $exp, '>', "$dir/$name.expected") or die "$dir/$name.expected: $!\n";
				print $exp $next->{text};
				close $exp;
			}
			print $idx join("\t", $name, $file, $b->{line}, $b->{lang}, join(' ', @{$b->{opts}})), "\n";
		}
	}
	close $idx;
}
elsif ($cmd eq 'expect')
{
	# expect EXPECTED LOG: every non-blank line of EXPECTED comes in LOG, in
	# that order (trailing blanks aside); names the first one missing.
	my ($expected, $log) = @ARGV;
	open(my $e, '<', $expected) or die "$expected: $!\n";
	open(my $l, '<', $log) or die "$log: $!\n";
	my @got = map { s/\s+$//r } <$l>;
	my $at = 0;
	for my $want (map { s/\s+$//r } <$e>)
	{
		next if $want eq '';
		$at++ while $at < @got && $got[$at] ne $want;
		if ($at >= @got)
		{
			print "the output lacks, in its place: $want\n";
			exit 1;
		}
		$at++;
	}
	exit 0;
}
elsif ($cmd eq 'go')
{
	# go TEMPLATE BLOCK FILE LINE: the program of a Go block (main.go.in).
	my ($template, $block, $file, $line) = @ARGV;
	local $/;
	open(my $t, '<', $template) or die "$template: $!\n";
	my $main = <$t>;
	open(my $b, '<', $block) or die "$block: $!\n";
	my $text = <$b>;
	my @names;
	for my $l (split /\n/, $text)
	{
		next unless $l =~ /^([A-Za-z_]\w*(?:\s*,\s*[A-Za-z_]\w*)*)\s*:=/;
		push @names, grep { $_ ne '_' } split /\s*,\s*/, $1;
	}
	# Compiler messages name the documentation's file and line.
	my $body = sprintf("//line %s:%d\n%s\n", $file, $line + 1, $text)
		. join('', map { $_ eq 'err' ? "mustBeNil(err)\n" : "_ = $_\n" } @names);
	$main =~ s/^\@BLOCK\@\n/$body/m or die "$template: no \@BLOCK\@ line\n";
	print $main;
}
else
{
	print STDERR "usage: $0 list|check FILE... | extract DIR FILE... | expect EXPECTED LOG | go TEMPLATE BLOCK FILE LINE\n";
	exit 2;
}
